"""The throughput workload: N requests with random token-id prompts and output lengths drawn
uniformly from ranges, a pure function of (seed, count, lengths, vocab). Offline
`kipp bench --num-requests` and `kipp bench serve` both run it, so "served / offline on the same
workload" compares like with like. Also the Poisson arrival times of a rate-driven load.

Each part draws from its own stream of the seed (numpy SeedSequence([seed, stream])), so that the
warm-up requests never share a prompt (nor a prefix-cache block) with the measured ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

MAX_ORDINARY_ID = 151643  # ids below <|endoftext|> are plain text tokens
WARMUP_MAX_TOKENS = 16  # warm-up requests compile kernels; their outputs need not be long
_WORKLOAD, _WARMUP, _ARRIVALS = 1, 2, 3  # the seed's streams


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: its prompt ids and exactly how many tokens it generates."""

    prompt_token_ids: list[int]
    max_tokens: int


def _lengths(rng: np.random.Generator, n: int, lo_hi: tuple[int, int], name: str) -> np.ndarray:
    lo, hi = lo_hi
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} range must satisfy 1 <= min <= max, got [{lo}, {hi}]")
    return rng.integers(lo, hi + 1, size=n)


def random_workload(
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    seed: int = 0,
    vocab: int = MAX_ORDINARY_ID,
    warmup: bool = False,
) -> list[WorkItem]:
    """`num_requests` items, prompt and output lengths uniform in the inclusive ranges, prompt
    ids uniform in [0, vocab). `warmup`: the untimed requests that go first instead (another
    stream of the seed, at most WARMUP_MAX_TOKENS out); they compile the kernel variants that
    mixed prefill and decode steps of random lengths first meet."""
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    if num_requests < 0:
        raise ValueError(f"num_requests must be non-negative, got {num_requests}")
    if not 1 <= vocab <= MAX_ORDINARY_ID:
        raise ValueError(f"vocab must be in [1, {MAX_ORDINARY_ID}], got {vocab}")
    rng = np.random.default_rng([seed, _WARMUP if warmup else _WORKLOAD])
    plen = _lengths(rng, num_requests, prompt_lens, "prompt length")
    olen = _lengths(rng, num_requests, output_lens, "output length")
    if warmup:
        olen = np.minimum(olen, WARMUP_MAX_TOKENS)
    return [
        WorkItem(rng.integers(0, vocab, size=int(p)).tolist(), int(o)) for p, o in zip(plen, olen)
    ]


def workload_digest(items: list[WorkItem]) -> str:
    """A short hash of the prompts and output lengths: two runs with equal digests ran the same
    requests."""
    h = hashlib.sha256()
    for w in items:
        h.update(np.asarray(w.prompt_token_ids, dtype=np.int64).tobytes())
        h.update(np.int64(-w.max_tokens).tobytes())  # negative: a separator no id can be
    return h.hexdigest()[:16]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each request is sent: the first at 0, then gaps drawn
    from Exponential(mean 1 / rate), as vLLM's benchmark_serving sends them."""
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"request rate must be a positive finite number, got {rate}")
    if num_requests <= 0:
        return np.zeros(0)
    gaps = np.random.default_rng([seed, _ARRIVALS]).exponential(1.0 / rate, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
