"""Scatter new K/V into the paged cache, and the cache format that the attention kernels read.

k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in bf16/fp16/fp32, or int8 with
k_scale, v_scale fp16 [num_blocks, block_size, num_kv_heads, head_dim // 32] (ggml q8_0 along
head_dim: d = amax / 127, q = roundf(x / d), halves away from zero; dequantized q * d).
slot_mapping [T] int64: block_id * block_size + offset per new token; a negative slot writes
nothing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait

QK8_0 = 32
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _load(ptrs, mask, HAS_MASK: tl.constexpr, CG: tl.constexpr):
    # CG: read through L2 (.cg), past this SM's L1, which may hold a stale line of the same
    # addresses loaded before a PDL wait (decode attention's first-tile prefetch)
    if HAS_MASK:
        if CG:
            x = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
        else:
            x = tl.load(ptrs, mask=mask, other=0)
    else:
        if CG:
            x = tl.load(ptrs, cache_modifier=".cg")
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def load_kv_tile(
    cache_ptr,
    scale_ptr,
    row,
    scale_row,
    mask,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_Q8: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CG: tl.constexpr = False,
):
    """A [BLOCK_N, HEAD_DIM] tile of K or V in DOT_DTYPE; `row`/`scale_row` are [BLOCK_N] element
    offsets of each position's head vector in the cache and in the scales (int64); positions
    outside `mask` (when HAS_MASK) are not read and come back as zeros. CG: through L2 (_load)."""
    if IS_Q8:
        # [BLOCK_N, HEAD_DIM // 32, 32] so that each 32-group meets its scale; fp32 dequant.
        j = tl.arange(0, HEAD_DIM // 32)
        i = tl.arange(0, 32)
        offs = row[:, None, None] + j[None, :, None] * 32 + i[None, None, :]
        x = _load(cache_ptr + offs, mask[:, None, None], HAS_MASK, CG)
        d = _load(scale_ptr + scale_row[:, None] + j[None, :], mask[:, None], HAS_MASK, CG)
        x = x.to(tl.float32) * d.to(tl.float32)[:, :, None]
        return tl.reshape(x, (BLOCK_N, HEAD_DIM)).to(DOT_DTYPE)
    else:
        offs = row[:, None] + tl.arange(0, HEAD_DIM)[None, :]
        x = _load(cache_ptr + offs, mask[:, None], HAS_MASK, CG)
        return x.to(DOT_DTYPE)


@triton.jit
def _quantize_store(src, dst, scale_dst, h_mask, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    # src, dst, scale_dst: [BLOCK_H] pointers to each head's vector; q8_0 in 32-groups.
    j = tl.arange(0, HEAD_DIM // 32)
    i = tl.arange(0, 32)
    col = j[None, :, None] * 32 + i[None, None, :]
    mask = h_mask[:, None, None]
    x = tl.load(src[:, None, None] + col, mask=mask, other=0).to(tl.float32)
    # Correctly rounded divisions, as numpy does, so the int8 values match bit for bit.
    amax = tl.max(tl.abs(x), axis=2)
    d = tl.math.div_rn(amax, 127.0)
    one = tl.full((BLOCK_H, HEAD_DIM // 32), 1.0, tl.float32)
    inv = tl.where(d == 0, 0.0, tl.math.div_rn(one, tl.where(d == 0, 1.0, d)))
    y = x * inv[:, :, None]
    q = tl.where(y < 0, -tl.floor(-y + 0.5), tl.floor(y + 0.5))  # halves away from zero
    tl.store(dst[:, None, None] + col, q.to(tl.int8), mask=mask)
    tl.store(scale_dst[:, None] + j[None, :], d.to(tl.float16), mask=h_mask[:, None])


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_Q8: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per new token, all kv heads at once.
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    h_mask = h < num_kv_heads
    dst = block_id * stride_cb + offset * stride_cs + h * stride_ch  # [BLOCK_H] int64
    if IS_Q8:
        sdst = block_id * stride_sb + offset * stride_ss + h * stride_sh
        _quantize_store(
            k_ptr + t * stride_kt + h * stride_kh,
            k_cache_ptr + dst,
            k_scale_ptr + sdst,
            h_mask,
            HEAD_DIM,
            BLOCK_H,
        )
        _quantize_store(
            v_ptr + t * stride_vt + h * stride_vh,
            v_cache_ptr + dst,
            v_scale_ptr + sdst,
            h_mask,
            HEAD_DIM,
            BLOCK_H,
        )
    else:
        d = tl.arange(0, HEAD_DIM)
        m2 = h_mask[:, None]
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m2)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m2)
        tl.store(k_cache_ptr + dst[:, None] + d[None, :], k, mask=m2)
        tl.store(v_cache_ptr + dst[:, None] + d[None, :], v, mask=m2)


def check_cache(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Validate a layer's cache; True for a Q8_0 cache."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{tuple(v_cache.shape)} {v_cache.dtype} must be equal "
            f"[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            f"k_cache/v_cache strides {k_cache.stride()}/{v_cache.stride()} must "
            f"match, with head_dim contiguous"
        )
    head_dim = k_cache.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    is_q8 = k_cache.dtype == torch.int8
    if is_q8:
        if head_dim % QK8_0:
            raise ValueError(f"a q8_0 cache needs head_dim divisible by 32, got {head_dim}")
        want = (*k_cache.shape[:3], head_dim // QK8_0)
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None or tuple(s.shape) != want or s.dtype != torch.float16:
                raise ValueError(
                    f"an int8 cache needs {name} float16 {want}, got "
                    f"{None if s is None else (tuple(s.shape), s.dtype)}"
                )
        if k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1:
            raise ValueError("k_scale/v_scale must have equal strides, last dim contiguous")
    elif k_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale are only for int8 caches, not {k_cache.dtype}")
    return is_q8


def dot_dtype(dtype: torch.dtype):
    """The tl dtype the attention kernels feed to tl.dot: the activations' dtype, except fp32 under
    the interpreter for bf16 (its bf16 arithmetic is wrong)."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return _TL_DTYPES[dtype]


def _kv_write_op(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store k, v [T, Hkv, D] at slot_mapping [T] (int64; negative: skip) of k_cache, v_cache
    [num_blocks, block_size, Hkv, D], quantizing to q8_0 (with k_scale, v_scale) for int8 caches."""
    is_q8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    T, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need head_dim contiguous")
    if not is_q8 and (k.dtype != k_cache.dtype or v.dtype != k_cache.dtype):
        raise ValueError(f"k/v {k.dtype}/{v.dtype} must match the cache dtype {k_cache.dtype}")
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{T}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if T == 0:
        return None
    s_strides = k_scale.stride()[:3] if is_q8 else (0, 0, 0)
    pdl = launch_kwargs(k.device)
    _kv_write_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *s_strides,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        IS_Q8=is_q8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
        enable_fp_fusion=False,  # no fma(x, 1/d, 0.5): round x / d exactly as numpy does
        PDL=bool(pdl),
        **pdl,
    )
    return None


def quantize_q8_0_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp16 [..., D // 32]), ggml q8_0 along the last axis."""
    g = x.float().reshape(*x.shape[:-1], -1, QK8_0)
    d = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    y = g * inv[..., None]
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return q.to(torch.int8).reshape(x.shape), d.to(torch.float16)


def dequantize_q8_0_ref(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    g = q.float().reshape(*q.shape[:-1], -1, QK8_0) * d.float()[..., None]
    return g.reshape(q.shape)


def kv_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    is_q8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])
        if is_q8:
            q, d = quantize_q8_0_ref(x[keep])
            flat[slots] = q
            scale.view(-1, *scale.shape[2:])[slots] = d
        else:
            flat[slots] = x[keep].to(cache.dtype)
    return None


kv_write = dispatch("kv_write", _kv_write_op, kv_write_ref)


def bench_specs() -> list[dict]:
    """Qwen3-8B shapes (Hkv 8, D 128): writing one decode step of 256 tokens and a 16k prompt."""
    dev = "cuda"
    specs = []
    for name, T, q8 in (
        ("kv_write decode 256 tok", 256, False),
        ("kv_write prefill 16k tok", 16384, False),
        ("kv_write prefill 16k tok q8", 16384, True),
    ):
        num_blocks, block_size, hkv, d = T // 32 + 8, 32, 8, 128
        k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cdt = torch.int8 if q8 else torch.bfloat16
        kc = torch.zeros(num_blocks, block_size, hkv, d, device=dev, dtype=cdt)
        vc = torch.zeros_like(kc)
        ks = vs = None
        if q8:
            ks = torch.zeros(num_blocks, block_size, hkv, d // 32, device=dev, dtype=torch.float16)
            vs = torch.zeros_like(ks)
        slots = torch.randperm(num_blocks * block_size, device=dev)[:T]
        nbytes = 2 * k.numel() * 2 + 2 * T * hkv * d * kc.element_size() + T * 8
        if q8:
            nbytes += 2 * T * hkv * (d // 32) * 2
        args = (k, v, kc, vc, slots, ks, vs)
        specs.append(
            {
                "name": name,
                "fn": lambda a=args: _kv_write_op(*a),
                "ref": lambda a=args: kv_write_ref(*a),
                "bytes": nbytes,
                "flops": 0,
            }
        )
    return specs


def check_attention_inputs(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, num_seqs: int
) -> bool:
    is_q8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[2:]
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads or q.stride(-1) != 1:
        raise ValueError(
            f"q {tuple(q.shape)} must be [tokens, Hq, {head_dim}] with Hq a multiple "
            f"of {num_kv_heads}, head_dim contiguous"
        )
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"unsupported q dtype {q.dtype}")
    if not is_q8 and q.dtype != k_cache.dtype:
        raise ValueError(f"q {q.dtype} must match the cache dtype {k_cache.dtype}")
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or block_tables.dtype != torch.int32
        or block_tables.stride(-1) != 1
    ):
        raise ValueError(
            f"block_tables must be int32 [{num_seqs}, max_blocks] row-major, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (num_seqs,) or context_lens.dtype != torch.int32:
        raise ValueError(
            f"context_lens must be int32 [{num_seqs}], got {context_lens.dtype} "
            f"{tuple(context_lens.shape)}"
        )
    return is_q8
