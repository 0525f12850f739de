"""step_advance (the last kernel of a decode graph, kernels/step_advance.py) against its torch
reference and against values derived by hand: tokens into the ring row of the counter, live rows
one position on with the next slot from their block-table row, padding untouched; on CPU under
Triton's interpreter, on a GPU with the ring in pinned host memory."""

from __future__ import annotations

import pytest
import torch

from kipp_cuda.kernels import step_advance as sa
from tests.cuda.kernel_testing import DEV, HAS_CUDA, skip_unless_runnable

skip_unless_runnable()


def _inputs(pos, slot, ctx, bt, tokens, counter):
    dev = torch.device(DEV)
    ring = torch.full(
        (sa.NUM_SLOTS, max(8, len(tokens))), -7, dtype=torch.int64, pin_memory=HAS_CUDA
    )
    return (
        torch.tensor(pos, dtype=torch.int64, device=dev),
        torch.tensor(slot, dtype=torch.int64, device=dev),
        torch.tensor(ctx, dtype=torch.int32, device=dev),
        torch.tensor(bt, dtype=torch.int32, device=dev),
        torch.tensor(tokens, dtype=torch.int64, device=dev),
        ring,
        torch.tensor([counter], dtype=torch.int64, device=dev),
    )


def _state(args):
    return [a.cpu().clone() for a in args]


# Block size 16. Row 0: position 14 -> 15, same block (7): slot 7 * 16 + 15. Row 1: position 15
# -> 16, its second block (9): 9 * 16 + 0. Row 2: padding (slot -1): untouched. Row 3: position
# 47 -> 48 past its 3-column table: the column clamps to 2 (block 4), 4 * 16 + 0.
HAND = dict(
    pos=[14, 15, 0, 47],
    slot=[7 * 16 + 14, 3 * 16 + 15, -1, 4 * 16 + 15],
    ctx=[15, 16, 1, 48],
    bt=[[7, 1, 2], [3, 9, 5], [6, 6, 6], [8, 2, 4]],
    tokens=[101, 202, 303, 404],
)


@pytest.mark.parametrize("impl", ["kernel", "ref"])
@pytest.mark.parametrize("counter", [0, 5])
def test_step_advance_by_hand(impl, counter):
    args = _inputs(**HAND, counter=counter)
    fn = sa.step_advance.op if impl == "kernel" else sa.step_advance_ref
    fn(*args, block_size=16)
    if HAS_CUDA:
        torch.cuda.synchronize()
    pos, slot, ctx, bt, tokens, ring, c = _state(args)
    assert pos.tolist() == [15, 16, 0, 48]
    assert slot.tolist() == [7 * 16 + 15, 9 * 16 + 0, -1, 4 * 16 + 0]
    assert ctx.tolist() == [16, 17, 1, 49]
    assert bt.tolist() == HAND["bt"] and tokens.tolist() == HAND["tokens"]
    row = counter % sa.NUM_SLOTS
    assert ring[row, :4].tolist() == HAND["tokens"] and ring[row, 4:].eq(-7).all()
    assert ring[[r for r in range(sa.NUM_SLOTS) if r != row]].eq(-7).all()
    assert c.tolist() == [counter + 1]


@pytest.mark.parametrize("size", [1, 3, 17])
def test_step_advance_kernel_equals_ref(size):
    g = torch.Generator().manual_seed(size)
    bs, width = 8, 5
    pos = torch.randint(0, bs * width + 3, (size,), generator=g)
    bt = torch.randint(0, 50, (size + 2, width), generator=g, dtype=torch.int64).int()
    slot = torch.where(torch.rand(size, generator=g) < 0.25, -1, pos % bs + 8)
    ctx = (pos + 1).int()
    tokens = torch.randint(0, 1000, (size,), generator=g)
    runs = []
    for fn in (sa.step_advance.op, sa.step_advance_ref):
        args = _inputs(pos.tolist(), slot.tolist(), ctx.tolist(), bt.tolist(), tokens.tolist(), 2)
        for _ in range(3):  # three steps: the ring rows 2, 3, 0 and the counter 2 -> 5
            fn(*args, block_size=bs)
        if HAS_CUDA:
            torch.cuda.synchronize()
        runs.append(_state(args))
    for got, want in zip(*runs):
        assert torch.equal(got, want)
    assert runs[0][6].tolist() == [5]


def test_step_advance_rejects_bad_operands():
    args = list(_inputs(**HAND, counter=0))
    with pytest.raises(ValueError, match="ring"):
        sa.step_advance_ref(*args[:5], args[5][:, :2], args[6], block_size=16)
    with pytest.raises(ValueError, match="int32 ctx"):
        sa.step_advance_ref(*args[:2], args[2].long(), *args[3:], block_size=16)
    with pytest.raises(ValueError, match="one entry a row"):
        sa.step_advance_ref(args[0][:3], *args[1:], block_size=16)
