"""Helpers for the MLX backend tests: run a backend directly on chosen block tables."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the MLX backend needs mlx (pip install -e '.[mlx]')")

from kipp_core.backend import BackendOptions, ModelInput, SeqInput  # noqa: E402
from kipp_core.checkpoint import Checkpoint  # noqa: E402


def make_backend(path, **kw):
    from kipp_mlx.backend import MlxBackend

    kw.setdefault("dtype", "float32")
    kw.setdefault("num_blocks", 64)
    return MlxBackend(Checkpoint(path), BackendOptions(**kw))


def run_logits(be, ids, table=None, chunks=(None,), seq_id=1):
    """Raw logits of `ids` run in prefill chunks of the given sizes (None: the rest) on the blocks
    of `table` (default 0, 1, 2, ...)."""
    bs = be.block_size
    n_blocks = -(-len(ids) // bs)
    table = list(range(n_blocks)) if table is None else list(table)
    out, start = [], 0
    for c in list(chunks) + [None]:
        if start >= len(ids):
            break
        end = len(ids) if c is None else min(len(ids), start + c)
        s = SeqInput(seq_id, list(ids[start:end]), start, table, return_logits=True)
        out.append(be.execute(ModelInput([s]))[0].logits)
        start = end
    return np.concatenate(out)


def random_ids(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()
