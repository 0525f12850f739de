"""The last kernel of a decode graph: hand the step's tokens to the host and advance the staged
inputs to the next step of the same batch, so that a steady decode needs no copy in either
direction between graph replays (runner.ResidentDecode decides when the device's inputs are
already the next step's).

One program over the graph's `size` rows:
- tokens [size] (the argmax the graph wrote into g_last) go to row `counter % NUM_SLOTS` of
  `ring` [NUM_SLOTS, width], pinned host memory written through its device address (UVA): no
  copy queued after the graph. The host reads that row after the step's event.
- each live row (slot >= 0; padding has slot -1 and stays as it is) moves to the next position:
  pos + 1, its context + 1, and the slot of pos + 1 from its block-table row (the column clamped
  to the table, so a position past the table reads a real entry; the host uploads then anyway).
- counter + 1.
POS, SLOT, the contexts, the block table and the counter are read before the PDL wait: no kernel
of this step writes them (they were uploaded before the graph, or advanced by the last replay).
It is a graph's last kernel, so it triggers no dependents (the next graph launch waits for it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_wait

NUM_SLOTS = 4  # ring rows: at most two steps are in flight (async scheduling)


@triton.jit
def _step_advance_kernel(
    pos_ptr, slot_ptr, ctx_ptr, bt_ptr, tokens_ptr, ring_ptr, counter_ptr, size, max_blocks,
    ring_width, block_size, NUM_SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    i = tl.arange(0, BLOCK)
    m = i < size
    pos = tl.load(pos_ptr + i, mask=m, other=0)
    slot = tl.load(slot_ptr + i, mask=m, other=-1)
    ctx = tl.load(ctx_ptr + i, mask=m, other=0)
    live = m & (slot >= 0)
    nxt = pos + 1
    col = tl.minimum(nxt // block_size, max_blocks - 1)
    blk = tl.load(bt_ptr + i.to(tl.int64) * max_blocks + col, mask=live, other=0)
    c = tl.load(counter_ptr)
    pdl_wait(PDL)  # the tokens come from the argmax before; every read of the inputs is done
    tok = tl.load(tokens_ptr + i, mask=m, other=0)
    tl.store(ring_ptr + (c % NUM_SLOTS) * ring_width + i, tok, mask=m)
    tl.store(pos_ptr + i, nxt, mask=live)
    tl.store(slot_ptr + i, blk.to(tl.int64) * block_size + nxt % block_size, mask=live)
    tl.store(ctx_ptr + i, ctx + 1, mask=live)
    tl.store(counter_ptr, c + 1)


def _check(pos, slot, ctx, bt, tokens, ring, counter, block_size: int) -> int:
    size = tokens.numel()
    if not (pos.numel() == slot.numel() == ctx.numel() == size <= bt.shape[0]):
        raise ValueError(
            f"step_advance: pos, slot, ctx and tokens need one entry a row and bt at least as "
            f"many rows, got {pos.numel()}, {slot.numel()}, {ctx.numel()}, {size}, {bt.shape[0]}"
        )
    if ring.dim() != 2 or ring.shape[0] != NUM_SLOTS or ring.shape[1] < size:
        raise ValueError(f"ring must be [{NUM_SLOTS}, >= {size}], got {tuple(ring.shape)}")
    dtypes = (pos.dtype, slot.dtype, tokens.dtype, ring.dtype, counter.dtype)
    if set(dtypes) != {torch.int64} or ctx.dtype != torch.int32 or bt.dtype != torch.int32:
        raise ValueError(f"step_advance: int64 rows/ring/counter, int32 ctx/bt; got {dtypes}")
    if counter.numel() != 1 or block_size < 1:
        raise ValueError(f"counter must hold one int64 and block_size be >= 1 ({block_size})")
    if not all(t.is_contiguous() for t in (pos, slot, ctx, bt, tokens, ring)):
        raise ValueError("step_advance needs contiguous tensors")
    return size


def _step_advance_op(pos, slot, ctx, bt, tokens, ring, counter, block_size: int) -> None:
    size = _check(pos, slot, ctx, bt, tokens, ring, counter, block_size)
    pdl = launch_kwargs(pos.device)
    _step_advance_kernel[(1,)](
        pos, slot, ctx, bt, tokens, ring, counter, size, bt.shape[1], ring.shape[1], block_size,
        NUM_SLOTS=NUM_SLOTS, BLOCK=triton.next_power_of_2(max(size, 2)), PDL=bool(pdl),
        num_warps=4, **pdl,
    )  # fmt: skip


def step_advance_ref(pos, slot, ctx, bt, tokens, ring, counter, block_size: int) -> None:
    """pos, slot [size] (int64 rows of the staged inputs), ctx [size] (int32), bt [>= size,
    max_blocks] (int32), tokens [size] (int64), ring [NUM_SLOTS, >= size] (int64, host memory on
    a GPU), counter [1] (int64): as the module docstring says, in place."""
    size = _check(pos, slot, ctx, bt, tokens, ring, counter, block_size)
    c = int(counter.item())
    ring[c % NUM_SLOTS, :size].copy_(tokens)
    live = slot >= 0
    nxt = pos + 1
    col = torch.clamp(nxt // block_size, max=bt.shape[1] - 1)
    blk = bt[:size].gather(1, col.view(-1, 1)).view(-1).to(torch.int64)
    slot.copy_(torch.where(live, blk * block_size + nxt % block_size, slot))
    pos.copy_(torch.where(live, nxt, pos))
    ctx.copy_(torch.where(live, ctx + 1, ctx))
    counter += 1


step_advance = dispatch("step_advance", _step_advance_op, step_advance_ref)
