"""The tile loop of paged decode attention (decode_attention.py): load one K/V tile of a kv head
from the paged cache, one online-softmax step over it, and a split's whole run of tiles with the
last, partial tile masked. Shapes: q [BLOCK_G, HEAD_DIM] (the kv head's query heads), K/V tiles
[BLOCK_N, HEAD_DIM], fp32 acc [BLOCK_G, HEAD_DIM] and statistics [BLOCK_G] in log2 units."""

from __future__ import annotations

import triton
import triton.language as tl

from kipp_cuda.kernels.kv_write import load_kv_tile


@triton.jit
def load_tile(
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    bt_row,
    n0,
    end,
    h,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_Q8: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CG: tl.constexpr = False,
):
    # K and V [BLOCK_N, HEAD_DIM] of KV positions [n0, min(n0 + BLOCK_N, end)) of kv head h,
    # both loads issued before any math uses them (V in flight with K). CG: the K/V and scale
    # loads go through L2 (kv_write._load).
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    if MASKED:
        block_id = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        block_id = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
    slot = block_id * stride_cb + (pos % PAGE_SIZE) * stride_cs + h * stride_ch
    sslot = block_id * stride_sb + (pos % PAGE_SIZE) * stride_ss + h * stride_sh
    k = load_kv_tile(
        k_cache_ptr, k_scale_ptr, slot, sslot, valid, HEAD_DIM, BLOCK_N, IS_Q8, MASKED,
        DOT_DTYPE, CG,
    )  # fmt: skip
    v = load_kv_tile(
        v_cache_ptr, v_scale_ptr, slot, sslot, valid, HEAD_DIM, BLOCK_N, IS_Q8, MASKED,
        DOT_DTYPE, CG,
    )  # fmt: skip
    return k, v


@triton.jit
def tile_math(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    n0,
    end,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One online-softmax step over the loaded tile (positions [n0, end) valid); fp32 statistics.
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
    if MASKED:
        qk = tl.where((n0 + tl.arange(0, BLOCK_N) < end)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def attend_run(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    bt_row,
    b,
    h,
    heads,
    g_mask,
    start,
    end,
    ctx,
    k_pre,
    v_pre,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_Q8: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # (acc, m, l) of the query heads `heads` over KV positions [start, end): fp32, log2 domain.
    # With PREFETCH, k_pre/v_pre hold the first tile, loaded before the PDL wait.
    rd = tl.arange(0, HEAD_DIM)
    # q rows: the G query heads of kv head h, padded to BLOCK_G with zeros.
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + rd[None, :],
        mask=g_mask[:, None],
        other=0,
    )
    q = q.to(DOT_DTYPE)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)  # fp32 accumulation
    first = start
    if PREFETCH:
        first_end = tl.minimum(start + BLOCK_N, end)
        if start < first_end:
            if first_end == ctx:  # the tile holds this step's token, stored by the kernel before
                # again, through L2: the early load may have left the stale lines in this SM's L1
                k_pre, v_pre = load_tile(
                    k_cache_ptr,
                    v_cache_ptr,
                    k_scale_ptr,
                    v_scale_ptr,
                    bt_row,
                    start,
                    first_end,
                    h,
                    stride_cb,
                    stride_cs,
                    stride_ch,
                    stride_sb,
                    stride_ss,
                    stride_sh,
                    HEAD_DIM,
                    BLOCK_N,
                    PAGE_SIZE,
                    IS_Q8,
                    True,
                    DOT_DTYPE,
                    True,
                )
            acc, m_i, l_i = tile_math(
                acc,
                m_i,
                l_i,
                q,
                k_pre,
                v_pre,
                start,
                first_end,
                qk_scale,
                BLOCK_N,
                True,
                DOT_DTYPE,
                PRECISION,
            )
        first = start + BLOCK_N
    # Whole tiles unmasked, then the sequence's ragged last tile, if any, masked.
    full_end = first + tl.maximum(end - first, 0) // BLOCK_N * BLOCK_N
    for n0 in range(first, full_end, BLOCK_N):
        k, v = load_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            bt_row,
            n0,
            end,
            h,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_sb,
            stride_ss,
            stride_sh,
            HEAD_DIM,
            BLOCK_N,
            PAGE_SIZE,
            IS_Q8,
            False,
            DOT_DTYPE,
        )
        acc, m_i, l_i = tile_math(
            acc, m_i, l_i, q, k, v, n0, end, qk_scale, BLOCK_N, False, DOT_DTYPE, PRECISION
        )
    if full_end < end:
        k, v = load_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            bt_row,
            full_end,
            end,
            h,
            stride_cb,
            stride_cs,
            stride_ch,
            stride_sb,
            stride_ss,
            stride_sh,
            HEAD_DIM,
            BLOCK_N,
            PAGE_SIZE,
            IS_Q8,
            True,
            DOT_DTYPE,
        )
        acc, m_i, l_i = tile_math(
            acc, m_i, l_i, q, k, v, full_end, end, qk_scale, BLOCK_N, True, DOT_DTYPE, PRECISION
        )
    return acc, m_i, l_i
