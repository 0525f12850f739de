"""Merging the (lse, out) partials of attention split along the KV sequence (flash-decoding).

A split s of a query head leaves out_s (its softmax-weighted V, fp32) and lse_s (the log2 of its
softmax denominator, -inf for a split with no positions). The merge is
out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_s - max lse), summed in split order; all
splits empty gives zeros. `merge_splits` runs it as a kernel of its own; `merge_head_group` is the
same math for the decode kernel's fused merge, where the last split program of a (sequence, kv
head) to finish merges (`count_in_and_merge`), counted on an int32 from `split_counters`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_splits", "stride_mt", "stride_mh", "stride_lt", "stride_lh"])
def merge_splits_kernel(
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
):
    # One (token, head): out = sum_s w_s out_s / sum_s w_s with w_s = 2^(lse_s - max lse).
    # An empty split has lse -inf (weight 0) and its out is not read.
    t = tl.program_id(0)
    head = tl.program_id(1)
    lse_row = mid_lse_ptr + t * stride_lt + head * stride_lh
    rs = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_row + rs, mask=rs < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all empty: out is 0
    den = tl.sum(tl.math.exp2(lse - lse_max), axis=0)
    rd = tl.arange(0, HEAD_DIM)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        rc = s0 + tl.arange(0, CHUNK_S)
        w = tl.math.exp2(tl.load(lse_row + rc, mask=rc < num_splits, other=float("-inf")) - lse_max)
        o = tl.load(
            mid_o_ptr + t * stride_mt + head * stride_mh + rc[:, None] * stride_ms + rd[None, :],
            mask=(w > 0)[:, None],
            other=0.0,
        )
        acc += tl.sum(o * w[:, None], axis=0)
    o = acc / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + rd, o.to(out_ptr.dtype.element_ty))


def merge_splits(out, mid_o, mid_lse) -> None:
    """out [T, H, D] from split partials mid_o [T, H, S, D], mid_lse [T, H, S] (fp32, log2)."""
    T, H, S, D = mid_o.shape
    merge_splits_kernel[(T, H)](
        out,
        mid_o,
        mid_lse,
        S,
        out.stride(0),
        out.stride(1),
        *mid_o.stride()[:3],
        *mid_lse.stride()[:2],
        HEAD_DIM=D,
        BLOCK_S=triton.next_power_of_2(S),
        CHUNK_S=min(16, triton.next_power_of_2(S)),
        num_warps=4,
    )


@triton.jit
def merge_head_group(
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    t,
    heads,
    head_mask,
    num_splits,
    used_splits,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    PEEL: tl.constexpr = False,
):
    """merge_splits_kernel's math for the query heads `heads` ([BLOCK_H], `head_mask` the real
    ones) of token t at once. Splits from `used_splits` on must be empty (lse -inf): they weigh 0
    and are not visited; those before it must all hold positions (their partials are read
    without waiting for their weights). Partials are read with .cg, through L2: this SM's L1 may
    hold stale lines of them (written by other programs, or left from an earlier call). PEEL: the
    first chunk's loads go out with the max's, before the weights exist (one L2 round trip fewer
    on the merging program's path; the same sums in the same order)."""
    rs = tl.arange(0, BLOCK_S)
    rd = tl.arange(0, HEAD_DIM)
    lse_rows = mid_lse_ptr + t * stride_lt + heads[:, None] * stride_lh  # [BLOCK_H, 1]
    o_rows = mid_o_ptr + t * stride_mt + heads[:, None, None] * stride_mh + rd[None, None, :]
    if PEEL:
        lse_0, o_0 = _merge_chunk_loads(
            lse_rows, o_rows, 0, head_mask, num_splits, used_splits, stride_ms, CHUNK_S
        )
    lse = tl.load(
        lse_rows + rs[None, :],
        mask=head_mask[:, None] & (rs < num_splits)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all empty: out is 0
    den = tl.sum(tl.math.exp2(lse - lse_max[:, None]), axis=1)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    first = 0
    if PEEL:
        acc += tl.sum(o_0 * tl.math.exp2(lse_0 - lse_max[:, None])[:, :, None], axis=1)
        first = CHUNK_S
    for s0 in range(first, used_splits, CHUNK_S):
        lse_c, o = _merge_chunk_loads(
            lse_rows, o_rows, s0, head_mask, num_splits, used_splits, stride_ms, CHUNK_S
        )
        w = tl.math.exp2(lse_c - lse_max[:, None])  # [BLOCK_H, CHUNK_S]
        acc += tl.sum(o * w[:, :, None], axis=1)
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + rd[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None],
    )


@triton.jit
def count_in_and_merge(
    counter,
    used,
    num_splits,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    t,
    head0,
    G,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    SKIP_EMPTY: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK_S: tl.constexpr,
    PEEL: tl.constexpr,
):
    """The fused merge's end of a split program, its partial stored: count in on `counter` (one
    a token and kv head); the program that arrives last merges query heads head0 .. head0 + G of
    the `used` splits that hold positions, then re-arms the counter for the next call or graph
    replay. Every split counts in, or with SKIP_EMPTY only the live ones (the others left early;
    an empty sequence: split 0 alone, its partial left out of the merge)."""
    # As matmul_tiles.store_tile: every thread's partial is stored before the barrier, the one
    # atomic releases them all and acquires everyone else's; its old value, shared with the
    # whole program, says whether this program arrived last.
    tl.debug_barrier()
    if SKIP_EMPTY:
        arrive = tl.maximum(used, 1)
    else:
        arrive = num_splits
    if tl.atomic_add(counter, 1, sem="acq_rel") == arrive - 1:
        rh = tl.arange(0, BLOCK_H)
        merge_head_group(
            out_ptr, mid_o_ptr, mid_lse_ptr, t, head0 + rh, rh < G, arrive, used, stride_ot,
            stride_oh, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, BLOCK_H, HEAD_DIM,
            BLOCK_S, CHUNK_S, PEEL,
        )  # fmt: skip
        tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_chunk_loads(
    lse_rows, o_rows, s0, head_mask, num_splits, used_splits, stride_ms, CHUNK_S: tl.constexpr
):
    # Splits [s0, s0 + CHUNK_S): their lse [BLOCK_H, CHUNK_S] and partials [BLOCK_H, CHUNK_S, D],
    # the partials masked by position only, not by weight: both loads go out together
    rc = s0 + tl.arange(0, CHUNK_S)
    lse_c = tl.load(
        lse_rows + rc[None, :],
        mask=head_mask[:, None] & (rc < num_splits)[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    o = tl.load(
        o_rows + rc[None, :, None] * stride_ms,
        mask=head_mask[:, None, None] & (rc < used_splits)[None, :, None],
        other=0.0,
        cache_modifier=".cg",
    )
    return lse_c, o


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 arrival counters for a fused-merge launch (one a sequence and kv head). They
    stay zeroed between calls (the merging program re-arms its own), one set a device, shared by
    every layer: fused-merge launches must not run concurrently on two streams. The first call
    with a larger n allocates, so make it before CUDA-graph capture (the runner's warm-up does);
    buffers are never freed, as a graph may hold them."""
    held = _COUNTERS.setdefault(torch.device(device), [])
    if not held or held[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"split_counters: {n} counters first asked for during CUDA-graph "
                "capture; make a warm-up call of the same size before capturing"
            )
        held.append(
            torch.zeros(max(4096, triton.next_power_of_2(n)), dtype=torch.int32, device=device)
        )
    return held[-1]
