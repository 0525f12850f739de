"""The tile step of paged prefill attention (prefill_attention.py): one online-softmax step of a
q tile over KV positions [n0, n0 + BLOCK_N), gathered through the block table. Shapes: q
[BLOCK_M, HEAD_DIM] ((query, head) rows), K/V tiles [BLOCK_N, HEAD_DIM], fp32 acc [BLOCK_M,
HEAD_DIM] and statistics [BLOCK_M] in log2 units; q_pos [BLOCK_M] each row's query position."""

from __future__ import annotations

import triton
import triton.language as tl

from kipp_cuda.kernels.kv_write import load_kv_tile


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    bt_row,
    n0,
    q_pos,
    h,
    qk_scale,
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
    PRECISION: tl.constexpr,
):
    # One online-softmax step over KV positions [n0, n0 + BLOCK_N); fp32 scores and sums.
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        # Positions past the last row's query are never read: they may lie past the context.
        valid = pos <= tl.max(q_pos, axis=0)
        block_id = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        valid = pos  # unused
        block_id = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
    slot = block_id * stride_cb + (pos % PAGE_SIZE) * stride_cs + h * stride_ch
    sslot = block_id * stride_sb + (pos % PAGE_SIZE) * stride_ss + h * stride_sh
    k = load_kv_tile(
        k_cache_ptr, k_scale_ptr, slot, sslot, valid, HEAD_DIM, BLOCK_N, IS_Q8, MASKED, DOT_DTYPE
    )
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_use = m_new
    if MASKED:  # a row may have seen nothing yet (a split above its query): keep it at 0
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = load_kv_tile(
        v_cache_ptr, v_scale_ptr, slot, sslot, valid, HEAD_DIM, BLOCK_N, IS_Q8, MASKED, DOT_DTYPE
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return acc, m_new, l_i
