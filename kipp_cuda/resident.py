"""Decode inputs that stay on the device between steps (vLLM's persistent batch, for the graphs).

Each decode graph ends with step_advance (kernels/step_advance.py): it writes the step's argmax
tokens into a pinned host ring through UVA and moves every live row of the staged inputs to the
next position. So when the next step is the same rows, each one token further on the same block
table, the device already holds its inputs: the runner replays the graph with no upload before it
and no copy of the tokens after it (each copy costs ~5-13 us of idle GPU between graphs:
benchmarks/LOG.md, entry 4937ed5). Anything else uploads as before.

`matches` is the whole test, on host values only: the same graph, the same rows, every row's
PENDING id taken from g_last (FROM = 1, as at the last upload), positions and contexts one more
than the last replay's, and the same block table. The new position's block is then in the table
the device holds, so the slot step_advance computed is the one the host would have staged.
On by default; KIPP_CUDA_RESIDENT_DECODE=0 turns it off (off, the graphs end at the argmax). On an
H200 the GPU idles 3.5 us between 8B decode steps with it and 25.9 us without (benchmarks/LOG.md,
entry baa1b47). Graph launches are stream-ordered against each other (PDL acts only between
kernels inside a graph), so the next replay reads what step_advance wrote.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from kipp_cuda.kernels.step_advance import NUM_SLOTS, step_advance
from kipp_cuda.staging import POS, SLOT


def resident_enabled() -> bool:
    return os.environ.get("KIPP_CUDA_RESIDENT_DECODE", "1").strip() not in ("0", "false", "no")


class ResidentDecode:
    def __init__(self, rows: int, block_size: int, device: torch.device):
        self.enabled = resident_enabled()
        self.block_size = block_size
        pin = device.type == "cuda"
        self.ring = torch.zeros((NUM_SLOTS, max(rows, 1)), dtype=torch.int64, pin_memory=pin)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.replays = 0  # the device counter's value, kept on the host
        self.last = None  # (key, positions, ctx, bt) of the last replay, if steady

    def advance(self, g_in: torch.Tensor, g_ctx: torch.Tensor, g_bt: torch.Tensor, tokens):
        """In a decode graph of len(tokens) rows, after the argmax (see the module docstring).
        The switch is read here, at capture, so that tools can capture both kinds of graph."""
        if resident_enabled():
            n = tokens.shape[0]
            step_advance(
                g_in[POS, :n], g_in[SLOT, :n], g_ctx[:n], g_bt, tokens, self.ring, self.counter,
                self.block_size,
            )  # fmt: skip

    def reset(self) -> None:
        """After capture: the warm-up runs advanced the counter; no inputs are resident."""
        self.enabled = resident_enabled()  # as the graphs were captured
        self.counter.zero_()
        self.replays, self.last = 0, None

    def matches(self, key, steady: bool, positions, ctx, bt) -> bool:
        """Whether the device holds this decode step's inputs already (module docstring)."""
        last = self.last
        return (
            self.enabled
            and steady
            and last is not None
            and last[0] == key
            and np.array_equal(positions, last[1] + 1)  # (False on a shape mismatch too)
            and np.array_equal(ctx, last[2] + 1)
            and np.array_equal(bt, last[3])
        )

    def replayed(self, key, steady: bool, positions, ctx, bt) -> int | None:
        """Count a decode graph's replay; returns the ring row its tokens go to (None when off).
        steady: every row took its PENDING id from g_last, so the replay can be continued."""
        if not self.enabled:
            return None
        self.last = (key, positions, ctx, bt) if steady else None  # (fresh arrays a step)
        self.replays += 1
        return self.replays - 1

    def forget(self) -> None:
        """Another graph (a prefill) wrote the shared staged inputs."""
        self.last = None

    def read(self, replay: int, k: int) -> torch.Tensor:
        """The first k tokens that replay `replay` wrote (after its event has completed)."""
        if self.replays - replay >= NUM_SLOTS:
            raise RuntimeError(f"ring row of replay {replay} was reused ({self.replays} replays)")
        return self.ring[replay % NUM_SLOTS, :k]
