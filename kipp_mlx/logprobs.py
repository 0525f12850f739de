"""Logprobs, ranks and top-N alternatives from raw logits on the device, as
kipp_core.sampling.logprobs: log-softmax in float32, top-N by logprob then lowest id."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kipp_core.sampling import TokenLogprob


def blocked_sum(x: mx.array, block: int = 16) -> mx.array:
    """Sum over the last axis as a tree of `block`-wide sums. MLX's CPU reduction adds in sequence
    in float32: over a 152k vocabulary its relative error reaches 3e-4 (1e-5 for blocks of 256
    over a flat tail); a tree of 16s stays near numpy's pairwise sum."""
    while x.shape[-1] > block:
        pad = -x.shape[-1] % block
        if pad:
            x = mx.concatenate([x, mx.zeros((*x.shape[:-1], pad), dtype=x.dtype)], axis=-1)
        x = mx.sum(x.reshape(*x.shape[:-1], -1, block), axis=-1)
    return mx.sum(x, axis=-1, keepdims=True)


def log_softmax(x: mx.array) -> mx.array:
    s = x - mx.max(x, axis=-1, keepdims=True)
    return s - mx.log(blocked_sum(mx.exp(s)))


def _top_host(row: np.ndarray, n: int) -> list[tuple[int, float]]:
    nth = np.partition(row, row.size - n)[row.size - n]
    cand = np.flatnonzero(row >= nth)
    cand = cand[np.lexsort((cand, -row[cand]))][:n]
    return [(int(i), float(row[i])) for i in cand]


def token_logprobs(
    logits: mx.array, token_ids: Sequence[int], top_n: Sequence[int]
) -> list[TokenLogprob]:
    """Row r of `logits` [R, V] scores `token_ids[r]` with `top_n[r]` alternatives."""
    R, V = logits.shape
    for t in token_ids:
        if not 0 <= t < V:
            raise ValueError(f"token_id must be in [0, {V}), got {t!r}")
    for n in top_n:
        if n < 0:
            raise ValueError(f"top_n must be >= 0, got {n!r}")
    lp = log_softmax(logits.astype(mx.float32))
    mine = mx.take_along_axis(lp, mx.array(list(token_ids), dtype=mx.int32)[:, None], axis=-1)
    rank = 1 + mx.sum(lp > mine, axis=-1)
    n = min(max(top_n, default=0), V)
    outs = [mine[:, 0], rank]
    if n:
        # A candidate set of n; exact unless the n-th value has ties outside it (host fallback).
        # One alternative is the argmax (lowest id of the largest), cheaper than a partition.
        if n == 1:
            cand = mx.argmax(lp, axis=-1, keepdims=True)
        else:
            cand = mx.argpartition(-lp, kth=n - 1, axis=-1)[:, :n]
        vals = mx.take_along_axis(lp, cand, axis=-1)
        n_ge = mx.sum(lp >= mx.min(vals, axis=-1, keepdims=True), axis=-1)
        outs += [cand, vals, n_ge]
    mx.eval(outs)
    host = [np.array(o) for o in outs]
    result = []
    for r, t in enumerate(token_ids):
        k = min(top_n[r], V)
        top: list[tuple[int, float]] = []
        if k:
            cand, vals, n_ge = host[2][r], host[3][r], host[4][r]
            if n_ge == n:
                order = np.lexsort((cand, -vals))[:k]
                top = [(int(cand[i]), float(vals[i])) for i in order]
            else:
                top = _top_host(np.array(lp[r]), k)
        result.append(TokenLogprob(int(t), float(host[0][r]), int(host[1][r]), top))
    return result
