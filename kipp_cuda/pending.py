"""A queued step's samples on their way to the host: the step's outputs wait in PendingSamples
until `result()`, and the sampled tokens travel through pinned buffers that are reused. The next
step's PENDING ids name those samples (pending_rows says which rows fill which ids)."""

from __future__ import annotations

import numpy as np
import torch

from kipp_core.backend import PENDING, ModelInput, SeqOutput


class PinnedRing:
    """Four pinned int64 buffers handed out in turn. At most two steps are in flight (async
    scheduling), and allocating pinned memory every step costs ~50 us of host time."""

    def __init__(self, size: int, device: torch.device):
        pin = device.type == "cuda"
        self.bufs = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(4 * pin)]
        self.i = 0

    def next(self) -> torch.Tensor | None:
        if not self.bufs:
            return None
        self.i = (self.i + 1) % len(self.bufs)
        return self.bufs[self.i]


class PendingSamples:
    """A queued step's outputs: everything but the sampled tokens is filled in; those are copied
    to pinned host memory behind the step and read when `result()` is called. `ring` =
    (ResidentDecode, replay): the decode graph wrote them to the host itself (resident.py), so
    nothing is copied, only waited for."""

    def __init__(
        self,
        outs: list[SeqOutput],
        rows: list[int] | None = None,
        tokens: torch.Tensor | None = None,
        pinned: torch.Tensor | None = None,
        ring=None,
    ):
        self.outs, self.rows = outs, rows or []
        self.host, self.done, self.ring = None, None, ring
        if ring is not None:
            self.host = tokens.shape[0]  # rows to read from the ring
            if tokens.is_cuda:
                self.done = torch.cuda.Event()
                self.done.record()
        elif tokens is not None:
            if tokens.is_cuda:
                n = tokens.shape[0]
                if pinned is None or pinned.shape[0] < n or pinned.dtype != tokens.dtype:
                    pinned = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                self.host = pinned[:n]
                self.host.copy_(tokens, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record()
            else:  # a copy: the tokens may be a graph's output, which the next step rewrites
                self.host = tokens.clone()

    def result(self) -> list[SeqOutput]:
        if self.host is not None:
            if self.done is not None:
                self.done.synchronize()
            if self.ring is not None:
                self.host = self.ring[0].read(self.ring[1], self.host)
            for i, t in zip(self.rows, self.host.tolist()):
                self.outs[i].token_ids = [t]
            self.host = None
        return self.outs


def pending_rows(batch: ModelInput, ids: np.ndarray, q_lens: np.ndarray, last_rows: dict):
    """(rows of ids that are PENDING, rows of the last step's samples that fill them), or None;
    last_rows maps a seq_id to its row of those samples."""
    dst = np.flatnonzero(ids == PENDING)
    if not len(dst):
        return None
    seq_of = np.searchsorted(np.cumsum(q_lens), dst, side="right")
    src = []
    for i in seq_of.tolist():
        row = last_rows.get(batch.seqs[i].seq_id)
        if row is None:
            raise RuntimeError(
                f"seq {batch.seqs[i].seq_id} has a PENDING token but the "
                f"last step sampled nothing for it"
            )
        src.append(row)
    return dst.tolist(), src


def in_order(pending: tuple[list[int], list[int]]) -> bool:
    """pending_rows' steady state: the last step's sampled sequences, in its order, first."""
    dst, src = pending
    return dst == src == list(range(len(dst)))
