"""Paged attention for one layer: store the new K/V in the cache (fused into qk-norm + RoPE for
caches that are not quantized), then attend over the context. The metadata travels as an explicit
argument, never through a global."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kipp_cuda.kernels.decode_attention import paged_decode_attention
from kipp_cuda.kernels.kv_write import kv_write
from kipp_cuda.kernels.prefill_attention import paged_prefill_attention
from kipp_cuda.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_kv_write


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64; negative = padding, writes nothing
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, KV positions including this step's tokens
    is_decode: bool  # every sequence has exactly one new token
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32 (varlen path)
    max_q_len: int = 1
    max_context_len: int | None = None  # fixed per CUDA graph; None = read from context_lens


@dataclass
class LayerKV:
    k: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # q8_0 KV: fp16 [num_blocks, block_size, Hkv, D / 32]
    v_scale: torch.Tensor | None = None


def store_qkv(
    qkv: torch.Tensor, layer, kv: LayerKV, meta: AttentionMetadata, positions, cos_sin
) -> torch.Tensor:
    """q/k norm and RoPE of a fused qkv [T, (Hq + 2 Hkv) D]; k and v go into the paged cache.
    Returns q [T, Hq, D]. One launch for bf16/fp16/fp32 caches; a q8_0 cache quantizes in
    kv_write."""
    args = (
        qkv,
        layer.q_norm,
        layer.k_norm,
        positions,
        cos_sin,
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        layer.eps,
    )
    if kv.k_scale is None:
        return qk_norm_rope_kv_write(*args, meta.slot_mapping, kv.k, kv.v)
    q, k = qk_norm_rope(*args)
    v = qkv[:, (layer.num_heads + layer.num_kv_heads) * layer.head_dim :]
    v = v.reshape(qkv.shape[0], layer.num_kv_heads, layer.head_dim)
    kv_write(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
    return q


def attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D] over the cached context (this step's K/V already stored) -> [T, Hq, D]."""
    if meta.is_decode:
        return paged_decode_attention(
            q,
            kv.k,
            kv.v,
            meta.block_tables,
            meta.context_lens,
            scale,
            kv.k_scale,
            kv.v_scale,
            meta.max_context_len,
        )
    return paged_prefill_attention(
        q,
        kv.k,
        kv.v,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.context_lens,
        scale,
        meta.max_q_len,
        kv.k_scale,
        kv.v_scale,
    )
