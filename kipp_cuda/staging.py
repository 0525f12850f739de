"""Host-to-device uploads that do not wait for the device.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream,
so every small upload in a step would wait for the step before it to finish. Going through pinned
memory with `non_blocking=True` queues the copy instead (PyTorch's pinned allocator keeps the host
buffer until the copy has run), which is what lets the engine queue step N+1 while step N runs.

`GraphInputs` is the CUDA graphs' input staging: one pinned byte buffer and its device twin,
uploaded as one prefix a step.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` as a tensor on `device`; on a CUDA device the copy is queued, not waited for."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def flat_inputs(batch, block_size: int):
    """A batch's rows as flat host arrays: token ids [T], positions [T], KV slots [T] (int64),
    block tables [B, widest] and context lengths [B] (int32), new tokens a sequence [B]."""
    seqs = batch.seqs
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int32, count=len(seqs))
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
    ids = np.fromiter(
        (t for s in seqs for t in s.token_ids), dtype=np.int64, count=int(q_lens.sum())
    )
    if len(seqs) == 1:
        positions = np.arange(starts[0], starts[0] + q_lens[0])
    elif (q_lens == 1).all():
        positions = starts
    else:
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, q_lens)])
    width = max(len(s.block_table) for s in seqs)
    bt = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        bt[i, : len(s.block_table)] = s.block_table
    seq_idx = np.repeat(np.arange(len(seqs)), q_lens)
    bs = block_size
    slots = bt[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
    ctx = (starts + q_lens).astype(np.int32)
    return ids, positions, slots, bt, ctx, q_lens


IDS, POS, SLOT, FROM = range(4)  # rows of the staged int64 inputs; FROM 1: take g_last's id
_ALIGN = 128  # bytes: each staged section starts aligned (kernels specialize on alignment)


class GraphInputs:
    """One pinned host byte buffer (h_*) and its device twin (g_*), viewed as the int64 rows
    [4, rows] (IDS, POS, SLOT, FROM), the int32 context lengths [n] and the int32 block tables
    [n, max_blocks]. The host writes the numpy views after `wait()`, then `upload(b)` sends
    everything up to block-table row b in one copy."""

    def __init__(self, rows: int, n: int, max_blocks: int, device: torch.device):
        rows = -(-rows // 16) * 16  # so that every int64 row starts _ALIGN-aligned too
        pin = device.type == "cuda"  # (CPU only in tests that stand in for the graphs)
        ctx_at = 4 * rows * 8
        self.bt_at = ctx_at + -(-4 * n // _ALIGN) * _ALIGN
        self.row_bytes = 4 * max_blocks
        size = self.bt_at + n * self.row_bytes
        self.h_stage = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
        self.g_stage = torch.zeros(size, dtype=torch.uint8, device=device)

        def views(buf):
            return (
                buf[:ctx_at].view(torch.int64).view(4, rows),
                buf[ctx_at : ctx_at + 4 * n].view(torch.int32),
                buf[self.bt_at :].view(torch.int32).view(n, max_blocks),
            )

        self.h_in_np, self.h_ctx_np, self.h_bt_np = (t.numpy() for t in views(self.h_stage))
        self.g_in, self.g_ctx, self.g_bt = views(self.g_stage)
        self.g_in[SLOT].fill_(-1)
        self.staged = torch.cuda.Event() if pin else None

    def wait(self) -> None:
        """Block until the last upload has left the pinned buffer (it may then be rewritten)."""
        if self.staged is not None:
            self.staged.synchronize()

    def upload(self, b: int) -> None:
        """Queue the copy of the staged inputs up to the end of block-table row b."""
        end = self.bt_at + b * self.row_bytes
        self.g_stage[:end].copy_(self.h_stage[:end], non_blocking=True)
        if self.staged is not None:
            self.staged.record()

    def stage_one_sequence(self, context: int, block_size: int) -> None:
        """Write the device inputs of one decoding sequence of `context` tokens (the last at
        position context - 1) on blocks 0, 1, ... in order, as a fresh allocation places it,
        without the engine: for tools that replay the batch-1 decode graph (step_ablation.py,
        tp_step_profile.py). A zero block table would have every attention tile read block 0."""
        self.g_ctx[0], self.g_in[POS, 0] = context, context - 1
        blocks = -(-context // block_size)
        self.g_bt[0, :blocks] = torch.arange(blocks, dtype=self.g_bt.dtype)
