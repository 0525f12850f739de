"""Paged decode attention: one new query token per sequence against its whole cached context.

A program handles one (sequence, kv head, split): the Hq / Hkv query heads of that kv head ride
together as the rows of a tl.dot (padded to 16), so each K/V tile is read once. Long contexts are
split along the sequence (flash-decoding) and the splits' (lse, out) partials merged
(split_merge.py). The split count comes from host ints only (batch, heads, `max_context_len`), so a
call is CUDA-graph safe; each sequence cuts its own context into that many runs of whole tiles on
the device, and programs whose run lies past their sequence do no attention.

With FUSED_MERGE (the default) there is no second kernel: every split program, empty ones too,
stores its partial and then counts itself in on an int32 per (sequence, kv head) with an acq_rel
atomic; the one that finds all the others already counted merges the partials of its query heads
in split order (deterministic) and re-arms the counter to 0 for the next call or graph replay;
with SKIP_EMPTY_SPLITS (the default) programs past the sequence leave at once instead, before
their PDL wait, and only the live splits (a prefix) count in. Otherwise a merge_splits kernel
follows. Each tile's V load is issued with its K load, before the QK dot and softmax, so that both
are in flight together.

With PREFETCH_KV (the default) a split program loads its first K/V tile before its PDL wait,
while the kernel before (q/k norm + RoPE + KV write) still runs: every cached position but the
new token's was stored by earlier steps, and so were the block tables and context lengths. The
one program whose first tile holds the new token (position ctx - 1) loads that tile again after
the wait, through L2 (.cg): the early load may have left stale lines of it in this SM's L1
(tests/cuda/test_attention_compile.py checks the PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.attention_ref import attend_ref
from kipp_cuda.kernels.decode_tiles import attend_run, load_tile
from kipp_cuda.kernels.kv_write import check_attention_inputs, dot_dtype
from kipp_cuda.kernels.matmul_tiles import num_sms
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait
from kipp_cuda.kernels.split_merge import count_in_and_merge, merge_splits, split_counters

# Tuned on an H200 in the 8B batch-1 decode graph at 2.1k context (tools/sweep/step_ablation.py)
# unless a line says otherwise; [abc1234]: the sweep's entry in benchmarks/LOG.md and its record.
BLOCK_N = 64  # KV positions per tile (two 32-token pages)
MIN_TILES_PER_SPLIT = 1  # the fewest tiles a split reads (2: +0.02-0.05 ms) [4937ed5, 68aa99e]
MAX_SPLITS = 128
PROGRAMS_PER_SM = 4  # split until B * Hkv * splits reaches this many programs an SM: the 8B
# batch-1 splits keep one tile past 2,112 positions (2: +0.05 ms at 2.15k) [baa1b47, 68aa99e]
FUSED_MERGE = True  # the last split program merges (no merge kernel; attention_sweep.py) [7b4d427]
SKIP_EMPTY_SPLITS = True  # with FUSED_MERGE: splits past the sequence leave at once (the top)
PREFETCH_KV = True  # split launches load their first K/V tile before the PDL wait (the top);
# one-split (large-batch) launches do not; off costs 0.02-0.07 ms a step [752bd46, 68aa99e]
MERGE_CHUNK = 16384  # fp32 partial elements (heads x splits x head_dim) a fused-merge step reads
# (4096: +0.02 ms, 8192: +0.008, 32768: +0.11) [752bd46, 68aa99e]
MERGE_PEEL = False  # True: the fused merge reads its first chunk with the lse max (split_merge.py);
# on is 0.011-0.014 ms slower a step (q8_0: 0.008) [68aa99e]
NUM_WARPS = 2  # one-split launches: 4.07 TB/s of KV at batch 256 (4 warps: 3.96) [ebe2eb0]
NUM_WARPS_SPLIT = 4  # when the context is split (few sequences): 2 warps +0.07-0.21 ms a step,
# 8 +0.02-0.09 [752bd46, 5de113c, 68aa99e]
NUM_STAGES = 2  # software-pipelining depth of the tile loop, one-split launches [ebe2eb0]
NUM_STAGES_SPLIT = 1  # a batch-1 split is one tile: a 2nd stage only adds a prologue [5de113c]
LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_attention_kernel(
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    counters_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    IS_Q8: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    MIN_TILES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    SKIP_EMPTY: tl.constexpr,
    MERGE_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    MERGE_PEEL: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pdl_trigger(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, HEAD_DIM)
    g_mask = rg < G
    heads = h * G + rg
    # Context lengths and block tables are written before the step, never by the kernel before.
    ctx = tl.load(context_lens_ptr + b)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if ONE_SPLIT:
        start = 0
        end = ctx
    else:
        # Each sequence cuts its own context into runs of whole tiles (at least MIN_TILES), so a
        # graph captured for long contexts still spreads a short one over several programs.
        split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N), MIN_TILES) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, ctx)
        if FUSED_MERGE and SKIP_EMPTY and split > 0 and start >= ctx:
            return  # past the sequence: the live splits (a prefix) merge without it
    k_pre = tl.zeros((BLOCK_N, HEAD_DIM), DOT_DTYPE)
    v_pre = tl.zeros((BLOCK_N, HEAD_DIM), DOT_DTYPE)
    if PREFETCH:
        # The first tile's K/V are older steps' (only the new token's slot, position ctx - 1, is
        # written by the kernel before; attend_run reloads the tile that holds it), so they are
        # read while that kernel still runs.
        k_pre, v_pre = load_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            bt_row,
            start,
            tl.minimum(start + BLOCK_N, end),
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
    pdl_wait(PDL)  # q and this step's K/V come from the kernel before
    if ONE_SPLIT:
        live = ctx >= 0  # always: an empty sequence (a padded batch slot) still writes zeros
    else:
        live = start < ctx  # a split past the sequence attends to nothing
    if live:
        acc, m_i, l_i = attend_run(
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
            BLOCK_G,
            HEAD_DIM,
            BLOCK_N,
            PAGE_SIZE,
            IS_Q8,
            DOT_DTYPE,
            PRECISION,
            PREFETCH,
        )
        # An empty sequence leaves l_i == 0: write zeros, not NaN.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if ONE_SPLIT:
            tl.store(
                out_ptr + b * stride_ob + heads[:, None] * stride_oh + rd[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=g_mask[:, None],
            )
        else:
            tl.store(
                mid_o_ptr
                + b * stride_mb
                + heads[:, None] * stride_mh
                + split * stride_ms
                + rd[None, :],
                o,
                mask=g_mask[:, None],
            )
            tl.store(
                mid_lse_ptr + b * stride_lb + heads * stride_lh + split,
                m_i + tl.math.log2(l_i),
                mask=g_mask,
            )
    elif not ONE_SPLIT:  # past the sequence: an empty partial, weight 0 in the merge
        tl.store(
            mid_lse_ptr + b * stride_lb + heads * stride_lh + split,
            tl.full((BLOCK_G,), float("-inf"), tl.float32),
            mask=g_mask,
        )
    if not ONE_SPLIT:
        if FUSED_MERGE:
            count_in_and_merge(
                counters_ptr + b * tl.num_programs(1) + h,
                tl.minimum(tl.cdiv(ctx, split_len), num_splits),
                num_splits,
                out_ptr,
                mid_o_ptr,
                mid_lse_ptr,
                b,
                h * G,
                G,
                stride_ob,
                stride_oh,
                stride_mb,
                stride_mh,
                stride_ms,
                stride_lb,
                stride_lh,
                SKIP_EMPTY,
                MERGE_H,
                HEAD_DIM,
                BLOCK_S,
                CHUNK_S,
                MERGE_PEEL,
            )


def num_splits_for(
    batch: int, num_kv_heads: int, max_context_len: int, device: torch.device
) -> int:
    """How many sequence splits a decode call uses: host ints only (CUDA-graph safe)."""
    tiles = triton.cdiv(max(max_context_len, 1), BLOCK_N)
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), batch * num_kv_heads)
    return max(1, min(want, triton.cdiv(tiles, MIN_TILES_PER_SPLIT), MAX_SPLITS))


def _paged_decode_attention_op(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    k_scale=None,
    v_scale=None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (int8 with fp16 k_scale,
    v_scale [..., D // 32] for a q8_0 cache); block_tables [B, max_blocks] int32; context_lens [B]
    int32, counting the new token, whose K/V kv_write has already stored (0: a padded slot, whose
    output is 0). `max_context_len` (a host int, >= every context, fixed per CUDA graph) sets the
    split count; None reads context_lens.max(), a host sync. `fused_merge` (None: FUSED_MERGE)
    merges the splits in the attention kernel rather than in a second one; its counters are
    allocated by the first call of a given B * Hkv, so make one before CUDA-graph capture.
    Returns [B, Hq, D] in q's dtype.
    """
    B, num_q_heads, head_dim = q.shape
    is_q8 = check_attention_inputs(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, B
    )
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    G = num_q_heads // num_kv_heads
    out = torch.empty(B, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())  # a host sync: eager use only
    if num_splits is None:
        num_splits = num_splits_for(B, num_kv_heads, max_context_len, q.device)
    one_split = num_splits == 1
    fused = not one_split and (FUSED_MERGE if fused_merge is None else fused_merge)
    if one_split:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(
            B, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        mid_lse = torch.empty(B, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    counters = split_counters(q.device, B * num_kv_heads) if fused else out  # out: unused
    # The fused merge's blocks (1 when unused, so that they make no extra compilations).
    merge_h = triton.next_power_of_2(G) if fused else 1
    block_s = triton.next_power_of_2(num_splits) if fused else 1
    dt = dot_dtype(q.dtype)
    s_strides = k_scale.stride()[:3] if is_q8 else (0, 0, 0)
    pdl = launch_kwargs(q.device)
    _paged_decode_attention_kernel[(B, num_kv_heads, num_splits)](
        out,
        mid_o,
        mid_lse,
        counters,
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        scale * LOG2E,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *((0, 0, 0, 0, 0) if one_split else (*mid_o.stride()[:3], *mid_lse.stride()[:2])),
        *k_cache.stride()[:3],
        *s_strides,
        block_tables.stride(0),
        G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        HEAD_DIM=head_dim,
        BLOCK_N=BLOCK_N,
        PAGE_SIZE=page_size,
        IS_Q8=is_q8,
        ONE_SPLIT=one_split,
        MIN_TILES=MIN_TILES_PER_SPLIT,
        DOT_DTYPE=dt,
        PRECISION="ieee" if dt == tl.float32 else "tf32",
        PREFETCH=PREFETCH_KV and not one_split,
        FUSED_MERGE=fused,
        SKIP_EMPTY=SKIP_EMPTY_SPLITS,
        MERGE_H=merge_h,
        BLOCK_S=block_s,
        CHUNK_S=min(block_s, max(1, MERGE_CHUNK // (merge_h * head_dim))),
        MERGE_PEEL=bool(MERGE_PEEL) and fused,
        num_warps=NUM_WARPS if one_split else NUM_WARPS_SPLIT,
        num_stages=NUM_STAGES if one_split else NUM_STAGES_SPLIT,
        PDL=bool(pdl),
        **pdl,
    )
    if not one_split and not fused:
        merge_splits(out, mid_o, mid_lse)
    return out


def paged_decode_attention_ref(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    scale: float,
    k_scale=None,
    v_scale=None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:
    B, num_q_heads, head_dim = q.shape
    check_attention_inputs(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, B)
    out = torch.zeros(B, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    caches = (k_cache, v_cache, k_scale, v_scale)
    for b, n in enumerate(context_lens.tolist()):
        if n:  # fp32 scores and softmax, chunked
            pos = torch.tensor([n - 1], device=q.device)
            out[b] = attend_ref(q[b : b + 1], pos, *caches, block_tables[b], scale)[0].to(q.dtype)
    return out


paged_decode_attention = dispatch(
    "paged_decode_attention", _paged_decode_attention_op, paged_decode_attention_ref
)
