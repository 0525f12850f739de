"""Paged, varlen, causal flash attention for prompts, chunked prefill and short multi-token queries.

A program handles one q tile of one sequence for one kv head. Its BLOCK_M rows are (query, head)
pairs: BLOCK_Q = BLOCK_M // G consecutive queries times the G query heads of that kv head, so each
K/V tile, gathered through the block table, is read once for all G heads. KV tiles wholly below the
causal bound run without masks; the few that cross it are masked; those above it are skipped.
The grid is sized from host ints (T // BLOCK_Q + B tiles), each program finding its sequence by a
binary search over cu_seqlens_q, so a call is CUDA-graph safe.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.attention_ref import attend_ref
from kipp_cuda.kernels.decode_attention import LOG2E, MAX_SPLITS, PROGRAMS_PER_SM, merge_splits
from kipp_cuda.kernels.kv_write import check_attention_inputs, dot_dtype
from kipp_cuda.kernels.matmul_tiles import num_sms
from kipp_cuda.kernels.prefill_tiles import attend_tile

SPLIT_MAX_Q_LEN = 16  # longer queries have programs enough along the query axis


# Per-step ints (batch size, split count and the strides it sets, block-table width) are not
# specialized: each new 1 / multiple-of-16 pattern would compile another variant in the middle of
# serving (~2 s of a 0.6B throughput run on the H200 went to that).
@triton.jit(
    do_not_specialize=[
        "num_seqs",
        "num_splits",
        "stride_mt",
        "stride_mh",
        "stride_lt",
        "stride_lh",
        "stride_bt",
    ]
)
def _paged_prefill_attention_kernel(
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    qk_scale,
    num_seqs,
    num_kv_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_Q8: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Heads vary fastest and the last tiles (the longest causal rows) start first, so the long
    # programs of every head run early and neighbours share the KV prefix in L2.
    pid = tl.program_id(0)
    h = pid % num_kv_heads
    tile = tl.num_programs(0) // num_kv_heads - 1 - pid // num_kv_heads
    # Sequence b owns tiles [cu[b] // BLOCK_Q + b, cu[b + 1] // BLOCK_Q + b + 1): find b.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    b = lo
    q_begin = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_begin
    q_start = (tile - q_begin // BLOCK_Q - b) * BLOCK_Q
    if q_start >= q_len:
        return
    ctx = tl.load(context_lens_ptr + b)

    # rows: query q_start + r // G, head h * G + r % G; rows past BLOCK_Q * G or q_len are padding.
    r = tl.arange(0, BLOCK_M)
    qi = q_start + r // G
    heads = h * G + r % G
    row_ok = (r < BLOCK_Q * G) & (qi < q_len)
    q_last = tl.minimum(q_start + BLOCK_Q, q_len) - 1
    q_pos = ctx - q_len + tl.minimum(qi, q_last)  # padding rows copy the last row's bound
    rd = tl.arange(0, HEAD_DIM)
    t = (q_begin + qi).to(tl.int64)
    q = tl.load(
        q_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + rd[None, :],
        mask=row_ok[:, None],
        other=0,
    )
    q = q.to(DOT_DTYPE)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)  # fp32 accumulation
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    first_pos = ctx - q_len + q_start
    last_pos = ctx - q_len + q_last
    if IS_SPLIT:
        # Split this tile's KV range [0, last_pos] into num_splits runs of whole tiles.
        split = tl.program_id(1)
        split_len = tl.cdiv(tl.cdiv(last_pos + 1, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_lo + split_len, last_pos + 1)
    else:
        kv_lo = 0
        kv_hi = last_pos + 1
    # KV tiles wholly at or below the first row's position need no mask; the rest up to the
    # last row's position are masked; beyond it nothing is read.
    full_end = kv_lo + tl.maximum(tl.minimum(kv_hi, first_pos + 1) - kv_lo, 0) // BLOCK_N * BLOCK_N
    for n0 in range(kv_lo, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
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
            HEAD_DIM,
            BLOCK_N,
            PAGE_SIZE,
            IS_Q8,
            False,
            DOT_DTYPE,
            PRECISION,
        )
    for n0 in range(full_end, kv_hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(
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
            HEAD_DIM,
            BLOCK_N,
            PAGE_SIZE,
            IS_Q8,
            True,
            DOT_DTYPE,
            PRECISION,
        )

    if not IS_SPLIT:
        o = acc / l_i[:, None]  # every real row saw position 0, so l_i > 0
        tl.store(
            out_ptr + t[:, None] * stride_ot + heads[:, None] * stride_oh + rd[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        # A row that saw nothing in this split: out 0, lse -inf (weight 0 in the merge).
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            mid_o_ptr
            + t[:, None] * stride_mt
            + heads[:, None] * stride_mh
            + split * stride_ms
            + rd[None, :],
            o,
            mask=row_ok[:, None],
        )
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + t * stride_lt + heads * stride_lh + split, lse, mask=row_ok)


# "BLOCK_M,BLOCK_N,num_warps,num_stages" for the 128-row tiles of long queries, to try a tile
# inside a whole model (tools/sweep/attention_sweep.py --only prefill sweeps the kernel alone)
TILES_ENV = "KIPP_CUDA_PREFILL_TILES"


def prefill_config(max_q_len: int, G: int, dtype: torch.dtype) -> dict:
    """Tile sizes, from host ints only (deterministic; one compile per distinct config)."""
    block_m = min(128, max(16, triton.next_power_of_2(max_q_len * G), triton.next_power_of_2(G)))
    block_n = 64
    num_stages = 3 if block_m >= 64 else 2
    warps = 8 if block_m >= 128 else 4
    if dtype == torch.float32:  # fp32 tiles need twice the shared memory
        block_m, block_n, num_stages = min(block_m, 64), 32, 2
        warps = 4
    elif block_m == 128 and os.environ.get(TILES_ENV):
        block_m, block_n, warps, num_stages = (int(v) for v in os.environ[TILES_ENV].split(","))
    elif block_m == 128:
        # 32 keys a step, 4 warps: 16,384 queries over 131,072 keys in 84.6 ms against 105.9 ms
        # for 64 keys and 8 warps (390 against 311 TFLOP/s; 8B heads on an H200, record
        # benchmarks/2026-12-02-fa2aa13-h200/sweep_prefill.json)
        block_n, warps = 32, 4
    return {
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // G,
        "BLOCK_N": block_n,
        "num_warps": warps,
        "num_stages": num_stages,
    }


def prefill_num_splits(num_programs: int, max_q_len: int, device: torch.device) -> int:
    """Short queries (speculative verification) over long contexts get few programs: split their
    KV range like decode does. Host ints only; splits past a short context exit at once."""
    if max_q_len > SPLIT_MAX_Q_LEN:
        return 1
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), num_programs)
    return max(1, min(want, MAX_SPLITS))


def _paged_prefill_attention_op(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale: float,
    max_q_len: int,
    k_scale=None,
    v_scale=None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Varlen causal attention of new tokens over their paged contexts.

    q [T, Hq, D]: sequence b's q_len queries are q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], the i-th
    at position context_lens[b] - q_len + i, attending to positions 0..that one (cached prefix and
    new tokens, whose K/V kv_write has already stored). Cache layout as for decode. `max_q_len` (a
    host int) picks the tile shape and, for short queries, a split of the KV range.
    Returns [T, Hq, D] in q's dtype.
    """
    T, num_q_heads, head_dim = q.shape
    B = context_lens.shape[0]
    is_q8 = check_attention_inputs(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, B
    )
    if cu_seqlens_q.shape != (B + 1,) or cu_seqlens_q.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens_q must be int32 [{B + 1}], got {cu_seqlens_q.dtype} "
            f"{tuple(cu_seqlens_q.shape)}"
        )
    if max_q_len < 1:
        raise ValueError(f"max_q_len must be >= 1, got {max_q_len}")
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    G = num_q_heads // num_kv_heads
    out = torch.empty(T, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    cfg = prefill_config(max_q_len, G, q.dtype)
    num_tiles = T // cfg["BLOCK_Q"] + B
    if num_splits is None:
        num_splits = prefill_num_splits(num_tiles * num_kv_heads, max_q_len, q.device)
    if num_splits == 1:
        mid_o = mid_lse = out  # unused
        mid_strides = (0,) * 5
    else:
        mid_o = torch.empty(
            T, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty(T, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        mid_strides = (*mid_o.stride()[:3], *mid_lse.stride()[:2])
    dt = dot_dtype(q.dtype)
    s_strides = k_scale.stride()[:3] if is_q8 else (0, 0, 0)
    _paged_prefill_attention_kernel[(num_tiles * num_kv_heads, num_splits)](
        out,
        mid_o,
        mid_lse,
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale * LOG2E,
        B,
        num_kv_heads,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *mid_strides,
        *k_cache.stride()[:3],
        *s_strides,
        block_tables.stride(0),
        G=G,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        IS_Q8=is_q8,
        IS_SPLIT=num_splits > 1,
        DOT_DTYPE=dt,
        PRECISION="ieee" if dt == tl.float32 else "tf32",
        **cfg,
    )
    if num_splits > 1:
        merge_splits(out, mid_o, mid_lse)
    return out


def paged_prefill_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    context_lens,
    scale: float,
    max_q_len: int,
    k_scale=None,
    v_scale=None,
    num_splits: int | None = None,
) -> torch.Tensor:
    T, num_q_heads, head_dim = q.shape
    B = context_lens.shape[0]
    check_attention_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, B)
    out = torch.zeros(T, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(context_lens.tolist()):
        lq = cu[b + 1] - cu[b]
        if lq == 0:
            continue
        q_pos = torch.arange(n - lq, n, device=q.device)  # fp32 scores and softmax, chunked
        o = attend_ref(
            q[cu[b] : cu[b + 1]], q_pos, k_cache, v_cache, k_scale, v_scale, block_tables[b], scale
        )
        out[cu[b] : cu[b + 1]] = o.to(q.dtype)
    return out


paged_prefill_attention = dispatch(
    "paged_prefill_attention", _paged_prefill_attention_op, paged_prefill_attention_ref
)
