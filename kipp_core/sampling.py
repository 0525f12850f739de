"""Sampling parameters and the reference sampler (numpy, float32).

This module is the reference the device samplers (PyTorch/Triton, MLX) are tested against for
exact token equality, so every step is a short sequence of float32 elementwise ops, a sequential
cumsum and argmax/sort with ties broken by the lowest token id; randomness comes from an integer
hash of (seed, stream, step, salt), never from a stateful generator. A seeded request therefore
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kipp_core.noise import fmix32, gumbel, noise_keys, uniform  # noqa: F401 (re-exported)
from kipp_core.sampling_params import (  # noqa: F401 (re-exported)
    GREEDY_EPS,
    MAX_LOGPROBS,
    SamplingParams,
    resolve_seed,
    stop_token_set,
)

SALT_SAMPLE = 0  # Gumbel noise of `sample`
SALT_SPEC_ACCEPT = 1  # the accept test of speculative rejection sampling

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


# --- Sampling pipeline ----------------------------------------------------------------------------


@dataclass
class SamplerState:
    """What the sampler needs to know about one sequence. `stop_token_ids` is the set that ends it
    (`stop_token_set`); `stream` is the child index for n > 1."""

    params: SamplingParams
    seed: int
    stream: int = 0
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Samples still on the device (async scheduling): they count as steps. Penalties, which
    # need their values, are never applied with pending samples (the engine waits for them).
    num_pending: int = 0
    # Bool [vocab]: the only tokens a structured-outputs constraint allows this step (the
    # others' logits are -inf before anything else); logprobs stay the raw logits'.
    allowed: np.ndarray | None = None

    @property
    def step(self) -> int:
        return len(self.output_token_ids) + self.num_pending


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 + number of tokens with a strictly higher logprob
    top: list[tuple[int, float]] = field(default_factory=list)  # by logprob desc, then id asc


def _ids_below(ids: Iterable[int], v: int) -> np.ndarray:
    a = np.fromiter(ids, dtype=np.int64)
    return a[(a >= 0) & (a < v)]


def process_logits(logits: np.ndarray, st: SamplerState) -> np.ndarray:
    """The constraint's mask, logit bias, min_tokens, repetition / frequency / presence
    penalties (vLLM order); float32.

    Token ids outside the vocabulary are ignored.
    """
    p = st.params
    x = np.array(logits, dtype=_F32)
    v = x.shape[-1]
    if st.allowed is not None:
        x[~st.allowed] = _NEG_INF
    if p.logit_bias:
        ids = _ids_below(p.logit_bias, v)
        x[ids] += np.array([p.logit_bias[int(i)] for i in ids], dtype=_F32)
    if st.step < p.min_tokens:
        x[_ids_below(st.stop_token_ids, v)] = _NEG_INF
    if p.repetition_penalty != 1.0:
        seen = np.unique(
            np.concatenate([_ids_below(st.prompt_token_ids, v), _ids_below(st.output_token_ids, v)])
        )
        rp = _F32(p.repetition_penalty)
        with np.errstate(over="ignore"):  # +-inf is a defined outcome (SamplingParams' bounds)
            x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
    if p.frequency_penalty or p.presence_penalty:
        # Two separate subtractions, as vLLM does; the order matters in float32.
        counts = np.bincount(_ids_below(st.output_token_ids, v), minlength=v).astype(_F32)
        x -= _F32(p.frequency_penalty) * counts
        x -= _F32(p.presence_penalty) * (counts > 0).astype(_F32)
    return x


def _mask_min_p(x: np.ndarray, min_p: float) -> np.ndarray:
    # prob_i >= min_p * max_prob  <=>  exp(x_i - max) >= min_p: no normalizing sum needed.
    keep = np.exp(x - x.max()) >= _F32(min_p)
    return np.where(keep, x, _NEG_INF)


def _mask_top_k(x: np.ndarray, k: int) -> np.ndarray:
    kth = np.partition(x, x.size - k)[x.size - k]
    return np.where(x >= kth, x, _NEG_INF)  # ties with the k-th value stay


def _mask_top_p(x: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-x, kind="stable")  # descending, lowest id first among ties
    e = np.exp(x[order] - x[order[0]])
    c = np.cumsum(e, dtype=_F32)  # sequential float32 sum
    before = np.concatenate([np.zeros(1, _F32), c[:-1]])  # mass of strictly better tokens
    # Keep token j while the mass before it is < top_p (of the total): the smallest prefix
    # whose mass reaches top_p. A top_p that is 0 in float32 keeps the top token (vLLM's).
    n_keep = max(1, int(np.count_nonzero(before < _F32(top_p) * c[-1])))
    boundary = x[order[n_keep - 1]]
    return np.where(x >= boundary, x, _NEG_INF)  # ties with the last kept token stay


def filtered_logits(processed: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, then min_p, top_k, top_p (each on what the previous left); masked = -inf.

    For random sampling only (needs temperature >= GREEDY_EPS).
    """
    # True division by a float32 temperature: device code must not multiply by a reciprocal.
    with np.errstate(over="ignore"):
        x = np.asarray(processed, dtype=_F32) / _F32(params.temperature)
    if not np.isfinite(x.max()):  # everything masked (or a +inf logit): nothing to filter
        return x
    if params.min_p > 0:
        x = _mask_min_p(x, params.min_p)
    if 0 < params.top_k < x.size:
        x = _mask_top_k(x, params.top_k)
    if params.top_p < 1:
        x = _mask_top_p(x, params.top_p)
    return x


def sample(logits: np.ndarray, st: SamplerState) -> int:
    """The next token: greedy argmax, or Gumbel-max over `filtered_logits` with the noise
    `uniform(seed, stream, step, V, salt=0)`. Ties go to the lowest token id."""
    x = process_logits(logits, st)
    if st.params.is_greedy:
        return int(np.argmax(x))
    f = filtered_logits(x, st.params)
    u = uniform(st.seed, st.stream, st.step, f.size, SALT_SAMPLE)
    return int(np.argmax(f + gumbel(u)))


def probs(logits: np.ndarray, st: SamplerState) -> np.ndarray:
    """The float32 distribution `sample` draws from (one-hot on the argmax when greedy)."""
    x = process_logits(logits, st)
    if st.params.is_greedy:
        out = np.zeros(x.size, dtype=_F32)
        out[np.argmax(x)] = 1
        return out
    f = filtered_logits(x, st.params)
    if f.max() == np.inf:  # an overflowed logit: sample's argmax takes the first +inf
        out = np.zeros(f.size, dtype=_F32)
        out[np.argmax(f)] = 1
        return out
    e = np.exp(f - f.max())
    return e / e.sum(dtype=_F32)


def sample_batch(logits: np.ndarray, states: Sequence[SamplerState]) -> list[int]:
    """`sample` for each row of `logits` [B, V] with its state."""
    return [sample(row, st) for row, st in zip(logits, states, strict=True)]


# --- Logprobs -------------------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Stable float32 log-softmax over the last axis: x - max - log(sum(exp(x - max)))."""
    x = np.asarray(x, dtype=_F32)
    s = x - x.max(axis=-1, keepdims=True)
    return s - np.log(np.sum(np.exp(s), axis=-1, keepdims=True))


def _token_logprob(lp: np.ndarray, token_id: int, top_n: int) -> TokenLogprob:
    if not 0 <= token_id < lp.size:
        raise ValueError(f"token_id must be in [0, {lp.size}), got {token_id!r}")
    if top_n < 0:
        raise ValueError(f"top_n must be >= 0, got {top_n!r}")
    mine = lp[token_id]
    top: list[tuple[int, float]] = []
    n = min(top_n, lp.size)
    if n:
        # Candidates: everything >= the n-th largest value (ties included), then an exact sort.
        nth = np.partition(lp, lp.size - n)[lp.size - n]
        cand = np.flatnonzero(lp >= nth)
        cand = cand[np.lexsort((cand, -lp[cand]))][:n]
        top = [(int(i), float(lp[i])) for i in cand]
    rank = 1 + int(np.count_nonzero(lp > mine))
    return TokenLogprob(int(token_id), float(mine), rank, top)


def logprobs(logits: np.ndarray, token_id: int, top_n: int) -> TokenLogprob:
    """Logprob, rank and top-`top_n` alternatives of `token_id` under the raw model logits."""
    return _token_logprob(log_softmax(logits), int(token_id), top_n)


def logprobs_rows(logits: np.ndarray, token_ids: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """`logprobs` for each row of `logits` [L, V]; row i scores `token_ids[i]` (prompt scoring)."""
    lp = log_softmax(logits)
    if lp.shape[0] != len(token_ids):
        raise ValueError(f"token_ids must have {lp.shape[0]} entries, got {len(token_ids)}")
    return [_token_logprob(row, int(t), top_n) for row, t in zip(lp, token_ids)]
