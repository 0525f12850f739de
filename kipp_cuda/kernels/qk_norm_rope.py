"""Per-head RMSNorm of q and k over head_dim, then half-split (NeoX) RoPE; v stays in qkv.

qkv: [T, (Hq + 2 * Hkv) * D] (q heads, then k heads, then v heads); cos_sin: [max_pos, D] fp32
with cos in [:, :D/2] and sin in [:, D/2:]. The norm follows rms_norm (fp32 math, cast to the
activation dtype, times the weight rounded to it). RoPE then runs in fp32 on that rounded value with
fp32 cos/sin and rounds once: q1' = q1 cos - q2 sin, q2' = q2 cos + q1 sin (rotate_half(q) =
cat(-q2, q1)). transformers rounds cos/sin and each product to bf16 instead; this is the more exact
of the two and what the fp32 oracle computes.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kipp_core.rope import cos_sin
from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.kv_write import check_cache, kv_write_ref
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait

BLOCK_HEADS = 4  # heads a program: 12 programs a token for the 8B's 32 q, 8 k and 8 v heads.
# Tuned in the 8B affine4 decode graph on an H200 (8: +0.018 ms a step, 2: +0.010, 16: +0.017;
# benchmarks/LOG.md, entry 68aa99e): the kernel is a latency chain, shorter with less a program
NUM_WARPS = 4  # at 4 heads a program (8: +0.009 ms a step, 2: +0.042; the same entry)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    num_heads,
    num_kv_heads,
    eps,
    stride_qkv,
    stride_cs,
    stride_cb,
    stride_cs_,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, block of BLOCK_HEADS heads among the Hq + Hkv q and k heads, and with
    # WRITE_KV the Hkv v heads after them). Each head is handled as its two halves, so
    # rotate_half needs no data movement. WRITE_KV stores k and v straight into the paged cache
    # at slot_ptr[t] (negative: not stored) instead of writing k out.
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, HALF)
    is_q = heads < num_heads
    num_qk = num_heads + num_kv_heads
    valid = heads < num_qk + (num_kv_heads if WRITE_KV else 0)
    mask = valid[:, None]
    src = qkv_ptr + t * stride_qkv + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
    r = tl.math.rsqrt(var + eps)[:, None]
    # The q and k weights are shared by all heads of their kind.
    wq1 = tl.load(qw_ptr + d).to(tl.float32)[None, :]
    wq2 = tl.load(qw_ptr + HALF + d).to(tl.float32)[None, :]
    wk1 = tl.load(kw_ptr + d).to(tl.float32)[None, :]
    wk2 = tl.load(kw_ptr + HALF + d).to(tl.float32)[None, :]
    w1 = tl.where(is_q[:, None], wq1, wk1)
    w2 = tl.where(is_q[:, None], wq2, wk2)
    h1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    h2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d)[None, :]
    o1 = (h1 * cos - h2 * sin).to(dtype)
    o2 = (h2 * cos + h1 * sin).to(dtype)
    # q: [T, Hq, D] contiguous.
    q_dst = q_ptr + (t * num_heads + heads[:, None]) * HEAD_DIM + d[None, :]
    q_mask = mask & is_q[:, None]
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + HALF, o2, mask=q_mask)
    is_k = (heads >= num_heads) & (heads < num_qk)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            # v heads keep their raw values; cache [num_blocks, PAGE_SIZE, Hkv, D].
            is_v = heads >= num_qk
            kv_head = tl.where(is_v, heads - num_qk, heads - num_heads)
            row = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs_
            dst = row + kv_head[:, None] * stride_ch + d[None, :]
            k_mask = mask & is_k[:, None]
            v_mask = mask & is_v[:, None]
            tl.store(k_cache_ptr + dst, o1, mask=k_mask)
            tl.store(k_cache_ptr + dst + HALF, o2, mask=k_mask)
            tl.store(v_cache_ptr + dst, x1.to(dtype), mask=v_mask)
            tl.store(v_cache_ptr + dst + HALF, x2.to(dtype), mask=v_mask)
    else:
        # k: [T, Hkv, D] contiguous.
        k_dst = k_ptr + (t * num_kv_heads + heads[:, None] - num_heads) * HEAD_DIM + d[None, :]
        k_mask = mask & is_k[:, None]
        tl.store(k_dst, o1, mask=k_mask)
        tl.store(k_dst + HALF, o2, mask=k_mask)


def rope_cos_sin_cache(
    max_pos: int, head_dim: int, theta: float, device, rope_scaling: dict | None = None
) -> torch.Tensor:
    """[max_pos, head_dim] fp32: cos of the head_dim / 2 frequencies times each position, then
    their sin, with YaRN's blend and attention factor when `rope_scaling` says so. Computed by
    kipp_core.rope in numpy float32, as the oracle computes it, so the table is bit-identical to
    the oracle's (and the same on every device)."""
    cos, sin = cos_sin(np.arange(max_pos), head_dim, theta, rope_scaling, np.float32)
    half = head_dim // 2
    return torch.from_numpy(np.concatenate([cos[:, :half], sin[:, :half]], axis=-1)).to(device)


def _check(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim):
    T = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"qkv must be [T, {width}] for {num_heads}/{num_kv_heads} heads of "
            f"{head_dim}, got {tuple(qkv.shape)}"
        )
    if head_dim % 2 or q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,):
        raise ValueError(
            f"q_weight {tuple(q_weight.shape)} and k_weight {tuple(k_weight.shape)} "
            f"must be [{head_dim}] (even head_dim)"
        )
    if positions.shape != (T,) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [{T}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin must be fp32 [max_pos, {head_dim}], got {cos_sin.dtype} "
            f"{tuple(cos_sin.shape)}"
        )


def _check_kernel(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim):
    _check(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim)
    if head_dim & (head_dim - 1) or head_dim < 4:
        raise ValueError(f"the kernel needs a power-of-two head_dim, got {head_dim}")
    if qkv.stride(1) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("qkv and cos_sin need their last dimension contiguous")


def _qk_norm_rope_op(
    qkv,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
):
    _check_kernel(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim)
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((T, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q, k
    block_heads = min(BLOCK_HEADS, triton.next_power_of_2(num_heads + num_kv_heads))
    pdl = launch_kwargs(qkv.device)
    grid = (T, triton.cdiv(num_heads + num_kv_heads, block_heads))
    _qk_norm_rope_kernel[grid](
        qkv,
        q_weight.contiguous(),
        k_weight.contiguous(),
        positions,
        cos_sin,
        q,
        k,
        positions,
        q,
        q,  # unused without WRITE_KV
        num_heads,
        num_kv_heads,
        float(eps),
        qkv.stride(0),
        cos_sin.stride(0),
        0,
        0,
        0,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=block_heads,
        WRITE_KV=False,
        PAGE_SIZE=1,
        num_warps=NUM_WARPS,
        PDL=bool(pdl),
        **pdl,
    )
    return q, k


def _norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (h.to(x.dtype).float() * w.float()).to(x.dtype)


def qk_norm_rope_ref(
    qkv,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
):
    _check(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim)
    T, half = qkv.shape[0], head_dim // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    outs = []
    for lo, n, w in ((0, num_heads, q_weight), (num_heads, num_kv_heads, k_weight)):
        x = qkv[:, lo * head_dim : (lo + n) * head_dim].reshape(T, n, head_dim)
        h = _norm_ref(x, w, eps).float()
        h1, h2 = h[..., :half], h[..., half:]
        o = torch.cat([h1 * cos - h2 * sin, h2 * cos + h1 * sin], dim=-1)
        outs.append(o.to(qkv.dtype).contiguous())
    return outs[0], outs[1]


qk_norm_rope = dispatch("qk_norm_rope", _qk_norm_rope_op, qk_norm_rope_ref)


def _check_cache(qkv, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim):
    check_cache(k_cache, v_cache, None, None)
    if k_cache.dtype != qkv.dtype or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"the cache {k_cache.dtype} {tuple(k_cache.shape)} must be "
            f"{qkv.dtype} [num_blocks, block_size, {num_kv_heads}, {head_dim}]"
        )
    if slot_mapping.shape != (qkv.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{qkv.shape[0]}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )


def _qk_norm_rope_kv_write_op(
    qkv,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    slot_mapping,
    k_cache,
    v_cache,
) -> torch.Tensor:
    """qk_norm_rope, then kv_write of its k and of qkv's v into a (not quantized) paged cache, in
    one launch. Returns q [T, Hq, D]."""
    _check_kernel(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim)
    _check_cache(qkv, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim)
    T = qkv.shape[0]
    q = torch.empty((T, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    heads = num_heads + 2 * num_kv_heads
    block_heads = min(BLOCK_HEADS, triton.next_power_of_2(heads))
    pdl = launch_kwargs(qkv.device)
    _qk_norm_rope_kernel[(T, triton.cdiv(heads, block_heads))](
        qkv,
        q_weight.contiguous(),
        k_weight.contiguous(),
        positions,
        cos_sin,
        q,
        q,
        slot_mapping,
        k_cache,
        v_cache,
        num_heads,
        num_kv_heads,
        float(eps),
        qkv.stride(0),
        cos_sin.stride(0),
        *k_cache.stride()[:3],
        HEAD_DIM=head_dim,
        BLOCK_HEADS=block_heads,
        WRITE_KV=True,
        PAGE_SIZE=k_cache.shape[1],
        num_warps=NUM_WARPS,
        PDL=bool(pdl),
        **pdl,
    )
    return q


def qk_norm_rope_kv_write_ref(
    qkv,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    slot_mapping,
    k_cache,
    v_cache,
) -> torch.Tensor:
    _check_cache(qkv, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim)
    q, k = qk_norm_rope_ref(
        qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim, eps
    )
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].reshape(-1, num_kv_heads, head_dim)
    kv_write_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


qk_norm_rope_kv_write = dispatch(
    "qk_norm_rope_kv_write", _qk_norm_rope_kv_write_op, qk_norm_rope_kv_write_ref
)


def bench_specs(device: str = "cuda") -> list[dict]:
    """Qwen3 0.6B (16/8 heads) and 8B (32/8 heads), head_dim 128, positions up to 40960."""
    from kipp_cuda.kernels.bench import MODELS, TOKENS

    specs = []
    for model, (_, hq, hkv, D, _) in MODELS.items():
        cos_sin = rope_cos_sin_cache(40960, D, 1e6, device)
        for T in TOKENS:
            qkv = torch.randn(T, (hq + 2 * hkv) * D, device=device, dtype=torch.bfloat16)
            wq = torch.randn(D, device=device, dtype=torch.bfloat16)
            wk = torch.randn(D, device=device, dtype=torch.bfloat16)
            pos = torch.randint(0, 40960, (T,), device=device)
            args = (qkv, wq, wk, pos, cos_sin, hq, hkv, D, 1e-6)
            # q and k read and written once, one cos/sin row and position a token.
            nbytes = 2 * T * (hq + hkv) * D * 2 + T * (D * 4 + 8)
            specs.append(
                {
                    "name": "qk_norm_rope",
                    "shape": f"{model} T={T} Hq={hq} Hkv={hkv} D={D}",
                    "fn": lambda a=args: qk_norm_rope(*a),
                    "ref": lambda a=args: qk_norm_rope_ref(*a),
                    "bytes": nbytes,
                    "flops": 0,
                }
            )
    return specs
