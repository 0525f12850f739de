"""Which CUDA graphs the runner captures: decode batch sizes, and the token buckets of
single-sequence prefill graphs (larger ones only where eager prefill is bound by its launches)."""

from __future__ import annotations

import os

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256)  # every model
LARGE_PREFILL_GRAPH_TOKENS = (512, 1024, 2048)  # models whose eager prefill is launch-bound
# A 2,048-token forward under this many FLOP (the 0.6B shape: 2.5e12, ~5 ms of H200 work) is
# bound by its ~250 launches from Python (~10 ms), so a padded replay wins even when half of it is
# padding; above it (1.7B: 7e12) padding would cost more than launches (benchmarks/LOG.md,
# entries ebe2eb0 and 7668e5f).
LARGE_PREFILL_MAX_FLOP = 4e12


def prefill_buckets(params: float, max_model_len: int) -> list[int]:
    """Token counts of the single-sequence prefill graphs for a model of `params` parameters (a
    rank's): up to 256 tokens for any model, up to 2,048 where a 2,048-token forward is under
    LARGE_PREFILL_MAX_FLOP. KIPP_CUDA_PREFILL_GRAPH_MAX (tokens) sets the largest bucket."""
    env = os.environ.get("KIPP_CUDA_PREFILL_GRAPH_MAX", "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"KIPP_CUDA_PREFILL_GRAPH_MAX must be a token count, got {env!r}")
        top = int(env)
    else:
        small = 2 * params * LARGE_PREFILL_GRAPH_TOKENS[-1] <= LARGE_PREFILL_MAX_FLOP
        top = LARGE_PREFILL_GRAPH_TOKENS[-1] if small else PREFILL_GRAPH_TOKENS[-1]
    every = (*PREFILL_GRAPH_TOKENS, *LARGE_PREFILL_GRAPH_TOKENS)
    return [t for t in every if t <= min(top, max_model_len)]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})
