"""Paged attention for one layer: write the new K/V into the cache, then attend over the context.
The metadata travels as an explicit argument, never through a global."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kipp_cuda.kernels.decode_attention import paged_decode_attention
from kipp_cuda.kernels.kv_write import kv_write
from kipp_cuda.kernels.prefill_attention import paged_prefill_attention


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    kv_write(k, v, kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
    if meta.is_decode:
        return paged_decode_attention(q, kv.k, kv.v, meta.block_tables, meta.context_lens, scale,
                                      kv.k_scale, kv.v_scale, meta.max_context_len)
    return paged_prefill_attention(q, kv.k, kv.v, meta.block_tables, meta.cu_seqlens_q,
                                   meta.context_lens, scale, meta.max_q_len, kv.k_scale,
                                   kv.v_scale)
