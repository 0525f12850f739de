"""Decode over an unquantized cache in one launch (an experiment, off by default): q/k RMSNorm,
RoPE and the K/V store of qk_norm_rope_kv_write (qk_norm_rope.py) inside paged decode attention
(decode_attention.py), so that a layer has one launch and one kernel boundary fewer.
KIPP_CUDA_FUSED_DECODE=1, read at each call (as the graphs are captured), turns it on in the model
(attention.attend); unset or 0 keeps the two launches. A q8_0 cache always takes them.

A program is decode_attention's (sequence, kv head, split), with the same split lengths, tiles,
settings (read from that module at each call) and fused merge: with it, split programs past the
sequence (never split 0) leave at once, and the live ones, a prefix, count in and merge. After
its PDL wait a program reads its G query heads from qkv [B, (Hq + 2 Hkv) D] and norms and ropes
them, as halves of D / 2, op for op as _qk_norm_rope_kernel does (the same bits under the
interpreter; a GPU may round the norm's sum differently in the last bit, as the two kernels'
reduction layouts differ).

The new token (position ctx - 1, slot slot_mapping[b]) is one program's: the one whose run
[start, end) holds ctx - 1, the last non-empty split. That program alone reads the token's k and
v rows from qkv, norms and ropes k, stores both into the cache, and takes them from registers
for its own tile: the row of ctx - 1 in the loaded tile is replaced (tl.where) before the QK dot.
Nothing in the launch reads that slot from memory: the other splits' runs end at or before
ctx - 1 (split boundaries are whole tiles), and the owner's own tile load may have read it (the
prefetch before the wait, or a masked load after) but that row is discarded. So no program waits
for the store and none needs the unfused kernel's .cg reload of its first tile. (Storing, then
reloading through L2 would put the store's round trip and a barrier on the owner's path, which
is the program the merge waits for.) This assumes slot_mapping[b] is the slot of position
ctx - 1, as every decode step stages it; a slot >= 0 with an empty context is stored by split 0.

PDL: every load before the wait is of something no kernel of this step writes: context lengths,
block tables, positions and slots (uploaded before the graph, or advanced by the last replay's
step_advance), the norm weights and the cos/sin row, and with FUSED_PREFETCH_KV the first K/V
tile (older steps' positions; the new token's row in it is discarded, above). qkv is read and
the cache, partials and counters written only after the wait. The prefetch is a setting of its
own: here the kernel before is the qkv GEMV, bandwidth-bound, with which an early K/V stream may
compete (step_ablation.py's da:FUSED_PREFETCH_KV=0).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.decode_tiles import load_tile, tile_math
from kipp_cuda.kernels.kv_write import check_attention_inputs, dot_dtype
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait
from kipp_cuda.kernels.qk_norm_rope import _check_cache, _check_kernel, qk_norm_rope_kv_write_ref
from kipp_cuda.kernels.split_merge import merge_head_group, merge_splits, split_counters

FUSED_PREFETCH_KV = True  # split launches load their first K/V tile before the PDL wait, as
# decode_attention.PREFETCH_KV; not measured in the fused kernel yet


def fused_decode_enabled() -> bool:
    """Whether the model takes the one-launch decode (read per call: KIPP_CUDA_FUSED_DECODE=1)."""
    return os.environ.get("KIPP_CUDA_FUSED_DECODE", "0").strip().lower() in ("1", "true", "yes")


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr):
    # _qk_norm_rope_kernel's math, op for op: heads [R, HEAD_DIM // 2] as their two halves in the
    # activation dtype, w/cos/sin [1, HEAD_DIM // 2] fp32 -> the two roped halves in that dtype
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
    r = tl.math.rsqrt(var + eps)[:, None]
    h1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    h2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (h1 * cos - h2 * sin).to(dtype), (h2 * cos + h1 * sin).to(dtype)


@triton.jit
def _cat(o1, o2, R: tl.constexpr, HEAD_DIM: tl.constexpr):
    # [R, D / 2] twice -> [R, D]: o1 then o2 along each row
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (R, HEAD_DIM))


@triton.jit
def _with_new_kv(k, v, n0, ctx, k_new, v_new, BLOCK_N: tl.constexpr):
    # The tile [n0, n0 + BLOCK_N)'s row of position ctx - 1, if it holds it, from the registers
    at = (n0 + tl.arange(0, BLOCK_N) == ctx - 1)[:, None]
    return tl.where(at, k_new, k), tl.where(at, v_new, v)


@triton.jit
def _attend_run(
    q, k_cache_ptr, v_cache_ptr, bt_row, h, start, end, ctx, k_pre, v_pre, k_new, v_new,
    qk_scale, stride_cb, stride_cs, stride_ch, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    # decode_tiles.attend_run with q in registers and the new token's row from k_new/v_new
    # ([1, HEAD_DIM]): (acc, m, l) over [start, end), fp32, log2 domain. Whole tiles run up to
    # the new token's tile (or to `end`, in the other splits, whose runs are whole tiles); that
    # tile is the last, masked, unless it was the prefetched first one.
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    first = start
    if PREFETCH:
        first_end = tl.minimum(start + BLOCK_N, end)
        if start < first_end:
            if first_end == ctx:  # the first tile holds the new token
                k_pre, v_pre = _with_new_kv(k_pre, v_pre, start, ctx, k_new, v_new, BLOCK_N)
            acc, m_i, l_i = tile_math(
                acc, m_i, l_i, q, k_pre, v_pre, start, first_end, qk_scale, BLOCK_N, True,
                DOT_DTYPE, PRECISION,
            )  # fmt: skip
        first = start + BLOCK_N
    last = tl.maximum(ctx - 1, 0) // BLOCK_N * BLOCK_N  # the new token's tile
    full_end = first + tl.maximum(tl.minimum(end, last) - first, 0) // BLOCK_N * BLOCK_N
    for n0 in range(first, full_end, BLOCK_N):
        k, v = load_tile(
            k_cache_ptr, v_cache_ptr, k_cache_ptr, v_cache_ptr, bt_row, n0, end, h, stride_cb,
            stride_cs, stride_ch, 0, 0, 0, HEAD_DIM, BLOCK_N, PAGE_SIZE, False, False, DOT_DTYPE,
        )  # fmt: skip
        acc, m_i, l_i = tile_math(
            acc, m_i, l_i, q, k, v, n0, end, qk_scale, BLOCK_N, False, DOT_DTYPE, PRECISION
        )
    if full_end < end:  # only the program that holds the new token gets here
        k, v = load_tile(
            k_cache_ptr, v_cache_ptr, k_cache_ptr, v_cache_ptr, bt_row, full_end, end, h,
            stride_cb, stride_cs, stride_ch, 0, 0, 0, HEAD_DIM, BLOCK_N, PAGE_SIZE, False, True,
            DOT_DTYPE,
        )  # fmt: skip
        k, v = _with_new_kv(k, v, full_end, ctx, k_new, v_new, BLOCK_N)
        acc, m_i, l_i = tile_math(
            acc, m_i, l_i, q, k, v, full_end, end, qk_scale, BLOCK_N, True, DOT_DTYPE, PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def _fused_decode_kernel(
    out_ptr, mid_o_ptr, mid_lse_ptr, counters_ptr, qkv_ptr, qw_ptr, kw_ptr, pos_ptr, cos_sin_ptr,
    slot_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, eps, qk_scale,
    num_splits, stride_qkv, stride_rope, stride_ob, stride_oh, stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh, stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, G: tl.constexpr,
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, ONE_SPLIT: tl.constexpr, MIN_TILES: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, FUSED_MERGE: tl.constexpr,
    MERGE_H: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
    MERGE_PEEL: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, HEAD_DIM)
    rh = tl.arange(0, HALF)[None, :]
    g_mask = rg < G
    heads = h * G + rg
    # Before the wait: what no kernel of this step writes (see the top).
    ctx = tl.load(context_lens_ptr + b)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if ONE_SPLIT:
        start = 0
        end = ctx
    else:
        split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N), MIN_TILES) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, ctx)
        if FUSED_MERGE and split > 0 and start >= ctx:
            return  # past the sequence: the live splits (a prefix) merge without it
    slot = tl.load(slot_ptr + b)
    cs_row = cos_sin_ptr + tl.load(pos_ptr + b) * stride_rope
    cos = tl.load(cs_row + rh)
    sin = tl.load(cs_row + HALF + rh)
    wq1 = tl.load(qw_ptr + rh).to(tl.float32)
    wq2 = tl.load(qw_ptr + HALF + rh).to(tl.float32)
    wk1 = tl.load(kw_ptr + rh).to(tl.float32)
    wk2 = tl.load(kw_ptr + HALF + rh).to(tl.float32)
    k_pre = tl.zeros((BLOCK_N, HEAD_DIM), DOT_DTYPE)
    v_pre = tl.zeros((BLOCK_N, HEAD_DIM), DOT_DTYPE)
    if PREFETCH:  # older steps' positions; the new token's row, if loaded, is replaced
        k_pre, v_pre = load_tile(
            k_cache_ptr, v_cache_ptr, k_cache_ptr, v_cache_ptr, bt_row, start,
            tl.minimum(start + BLOCK_N, end), h, stride_cb, stride_cs, stride_ch, 0, 0, 0,
            HEAD_DIM, BLOCK_N, PAGE_SIZE, False, True, DOT_DTYPE,
        )  # fmt: skip
    pdl_wait(PDL)  # qkv comes from the kernel before
    # This program holds the new token (its run ends at ctx); with an empty context, split 0
    # stores a live slot as qk_norm_rope_kv_write would.
    new = (start < ctx) & (ctx <= end)
    owns = new | ((split == 0) & (ctx <= 0))
    # All qkv loads at once: the G query heads as halves, and the owner's k and v rows.
    row = qkv_ptr + b.to(tl.int64) * stride_qkv
    q_src = row + heads[:, None] * HEAD_DIM + rh
    x1 = tl.load(q_src, mask=g_mask[:, None], other=0.0)
    x2 = tl.load(q_src + HALF, mask=g_mask[:, None], other=0.0)
    k_src = row + (NUM_Q_HEADS + h) * HEAD_DIM + rh
    # (masks built by comparison: the interpreter fails a tensor & a scalar bool)
    k1 = tl.load(k_src, mask=rh < tl.where(owns, HALF, 0), other=0.0)
    k2 = tl.load(k_src + HALF, mask=rh < tl.where(owns, HALF, 0), other=0.0)
    v_src = row + (NUM_Q_HEADS + NUM_KV_HEADS + h) * HEAD_DIM + rd[None, :]
    v_new = tl.load(v_src, mask=rd[None, :] < tl.where(owns, HEAD_DIM, 0), other=0.0)
    q1, q2 = _norm_rope(x1, x2, wq1, wq2, cos, sin, eps, HEAD_DIM)
    q = _cat(q1, q2, BLOCK_G, HEAD_DIM).to(DOT_DTYPE)
    k1, k2 = _norm_rope(k1, k2, wk1, wk2, cos, sin, eps, HEAD_DIM)
    if owns & (slot >= 0):
        dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + h * stride_ch
        tl.store(k_cache_ptr + dst + rh, k1)
        tl.store(k_cache_ptr + dst + HALF + rh, k2)
        tl.store(v_cache_ptr + dst + rd[None, :], v_new)
    k_new = _cat(k1, k2, 1, HEAD_DIM).to(DOT_DTYPE)
    v_new = v_new.to(DOT_DTYPE)
    if ONE_SPLIT:
        live = ctx >= 0  # always: an empty sequence (a padded batch slot) still writes zeros
    else:
        live = start < ctx
    # From here on decode_attention's kernel: the output or partial, and the fused merge.
    if live:
        acc, m_i, l_i = _attend_run(
            q, k_cache_ptr, v_cache_ptr, bt_row, h, start, end, ctx, k_pre, v_pre, k_new, v_new,
            qk_scale, stride_cb, stride_cs, stride_ch, BLOCK_G, HEAD_DIM, BLOCK_N, PAGE_SIZE,
            DOT_DTYPE, PRECISION, PREFETCH,
        )  # fmt: skip
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if ONE_SPLIT:
            dst_o = out_ptr + b * stride_ob + heads[:, None] * stride_oh + rd[None, :]
            tl.store(dst_o, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            dst_o = mid_o_ptr + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms
            tl.store(dst_o + rd[None, :], o, mask=g_mask[:, None])
            lse = m_i + tl.math.log2(l_i)
            tl.store(mid_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)
    elif not ONE_SPLIT:  # an empty partial: split 0 of an empty sequence, or merge_splits'
        tl.store(
            mid_lse_ptr + b * stride_lb + heads * stride_lh + split,
            tl.full((BLOCK_G,), float("-inf"), tl.float32),
            mask=g_mask,
        )
    if not ONE_SPLIT:
        if FUSED_MERGE:
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + h
            # The live splits count in (an empty sequence: split 0 alone, its partial empty).
            used = tl.minimum(tl.cdiv(ctx, split_len), num_splits)
            arrive = tl.maximum(used, 1)
            if tl.atomic_add(counter, 1, sem="acq_rel") == arrive - 1:
                rm = tl.arange(0, MERGE_H)
                merge_head_group(
                    out_ptr, mid_o_ptr, mid_lse_ptr, b, h * G + rm, rm < G, arrive, used,
                    stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                    MERGE_H, HEAD_DIM, BLOCK_S, CHUNK_S, MERGE_PEEL,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # re-armed for the next call (or graph replay)


def _paged_decode_attention_qkv_op(
    qkv, q_weight, k_weight, positions, cos_sin, num_heads: int, eps: float, slot_mapping,
    k_cache, v_cache, block_tables, context_lens, scale: float,
    max_context_len: int | None = None, num_splits: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """qk_norm_rope_kv_write then paged_decode_attention, in one launch: qkv [B, (Hq + 2 Hkv) D]
    (one new token a sequence, straight from qkv_proj), q_weight/k_weight/positions/cos_sin/eps
    as qk_norm_rope takes them, slot_mapping [B] int64 (the slot of position ctx - 1; negative:
    not stored), the rest as paged_decode_attention takes them (a bf16/fp16/fp32 cache in qkv's
    dtype). Stores this step's K/V and returns [B, Hq, D]."""
    B = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[-1]
    _check_kernel(qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim)
    _check_cache(qkv, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim)
    q = qkv[:, : num_heads * head_dim].view(B, num_heads, head_dim)
    check_attention_inputs(q, k_cache, v_cache, None, None, block_tables, context_lens, B)
    G = num_heads // num_kv_heads
    out = torch.empty(B, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return out
    if max_context_len is None:
        max_context_len = int(context_lens.max())  # a host sync: eager use only
    if num_splits is None:
        num_splits = dec.num_splits_for(B, num_kv_heads, max_context_len, qkv.device)
    one_split = num_splits == 1
    fused = not one_split and (dec.FUSED_MERGE if fused_merge is None else fused_merge)
    mid_o = mid_lse = out  # unused with one split
    if not one_split:
        f32 = dict(dtype=torch.float32, device=qkv.device)
        mid_o = torch.empty(B, num_heads, num_splits, head_dim, **f32)
        mid_lse = torch.empty(B, num_heads, num_splits, **f32)
    counters = split_counters(qkv.device, B * num_kv_heads) if fused else out  # out: unused
    merge_h = triton.next_power_of_2(G) if fused else 1
    block_s = triton.next_power_of_2(num_splits) if fused else 1
    dt = dot_dtype(qkv.dtype)
    pdl = launch_kwargs(qkv.device)
    _fused_decode_kernel[(B, num_kv_heads, num_splits)](
        out, mid_o, mid_lse, counters, qkv, q_weight.contiguous(), k_weight.contiguous(),
        positions, cos_sin, slot_mapping, k_cache, v_cache, block_tables, context_lens,
        float(eps), scale * dec.LOG2E, num_splits, qkv.stride(0), cos_sin.stride(0),
        out.stride(0), out.stride(1),
        *((0, 0, 0, 0, 0) if one_split else (*mid_o.stride()[:3], *mid_lse.stride()[:2])),
        *k_cache.stride()[:3], block_tables.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        G=G,
        BLOCK_G=max(16, triton.next_power_of_2(G)),
        HEAD_DIM=head_dim,
        BLOCK_N=dec.BLOCK_N,
        PAGE_SIZE=k_cache.shape[1],
        ONE_SPLIT=one_split,
        MIN_TILES=dec.MIN_TILES_PER_SPLIT,
        DOT_DTYPE=dt,
        PRECISION="ieee" if dt == tl.float32 else "tf32",
        FUSED_MERGE=fused,
        MERGE_H=merge_h,
        BLOCK_S=block_s,
        CHUNK_S=min(block_s, max(1, dec.MERGE_CHUNK // (merge_h * head_dim))),
        MERGE_PEEL=bool(dec.MERGE_PEEL) and fused,
        PDL=bool(pdl),
        PREFETCH=bool(FUSED_PREFETCH_KV) and not one_split,
        num_warps=dec.NUM_WARPS if one_split else dec.NUM_WARPS_SPLIT,
        num_stages=dec.NUM_STAGES if one_split else dec.NUM_STAGES_SPLIT,
        **pdl,
    )  # fmt: skip
    if not one_split and not fused:
        merge_splits(out, mid_o, mid_lse)
    return out


def paged_decode_attention_qkv_ref(
    qkv, q_weight, k_weight, positions, cos_sin, num_heads: int, eps: float, slot_mapping,
    k_cache, v_cache, block_tables, context_lens, scale: float,
    max_context_len: int | None = None, num_splits: int | None = None,
    fused_merge: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[-1]
    q = qk_norm_rope_kv_write_ref(
        qkv, q_weight, k_weight, positions, cos_sin, num_heads, num_kv_heads, head_dim, eps,
        slot_mapping, k_cache, v_cache,
    )  # fmt: skip
    return dec.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


paged_decode_attention_qkv = dispatch(
    "paged_decode_attention_qkv", _paged_decode_attention_qkv_op, paged_decode_attention_qkv_ref
)
