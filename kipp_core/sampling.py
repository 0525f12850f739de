"""Sampling parameters and the reference sampler (numpy, float32).

This module is the reference the device samplers (PyTorch/Triton, MLX) are tested against for
exact token equality, so every step is a short sequence of float32 elementwise ops, a sequential
cumsum and argmax/sort with ties broken by the lowest token id; randomness comes from an integer
hash of (seed, stream, step, salt), never from a stateful generator. A seeded request therefore
samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
SALT_SAMPLE = 0  # Gumbel noise of `sample`
SALT_SPEC_ACCEPT = 1  # the accept test of speculative rejection sampling

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


# --- SamplingParams -------------------------------------------------------------------------------


def _bad(name: str, rule: str, value) -> ValueError:
    return ValueError(f"{name} must be {rule}, got {value!r}")


def _as_int(name: str, value) -> int:
    # bool is an int subclass; `top_k=True` is a caller bug, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad(name, "an integer", value)
    return int(value)


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(name, "a number", value)
    f = float(value)
    if not math.isfinite(f):
        raise _bad(name, "finite", value)
    return f


def _as_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(name, "a bool", value)
    return bool(value)


def _in_range(name: str, value, lo, hi, as_num=_as_float):
    v = as_num(name, value)
    if not lo <= v <= hi:
        raise _bad(name, f"in [{lo}, {hi}]", value)
    return v


def _optional_count(name: str, value) -> int | None:
    return None if value is None else _in_range(name, value, 0, MAX_LOGPROBS, _as_int)


def _token_id(name: str, value) -> int:
    # JSON object keys are strings, so logit_bias arrives as {"1234": 5.0}.
    if isinstance(value, str):
        s = value.strip()
        if not (s.isascii() and s.isdigit()):
            raise _bad(name, "token ids (non-negative integers)", value)
        return int(s)
    v = _as_int(name, value)
    if v < 0:
        raise _bad(name, "token ids (non-negative integers)", value)
    return v


def _stop_list(value) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise _bad("stop", "a string or a list of strings", value)
    if len(items) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} strings", value)
    for s in items:
        if not isinstance(s, str) or not s:
            raise _bad("stop", "non-empty strings", s)
    return list(items)


def _id_list(name: str, value) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _bad(name, "a list of token ids", value)
    out = []
    for t in value:
        if isinstance(t, str):  # "12" is not a token id here; only logit_bias keys are strings
            raise _bad(name, "token ids (non-negative integers)", t)
        out.append(_token_id(name, t))
    return out


def _logit_bias(value) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("logit_bias", "a dict of token id to bias", value)
    out = {}
    for k, b in value.items():
        tid = _token_id("logit_bias", k)
        out[tid] = _in_range("logit_bias", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request, with vLLM / OpenAI semantics; validated on construction.

    `stop` is normalized to a list of strings and `stop_token_ids` to a list of ints (`[]` for
    None); `logit_bias` keys to ints. `top_k` 0 or -1 means off. `max_tokens=None` means up to the
    context limit. Invalid values raise `ValueError` naming the field and the value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        for name, value in self._validated().items():
            object.__setattr__(self, name, value)

    def _validated(self) -> dict:
        v = {
            "n": _in_range("n", self.n, 1, MAX_N, _as_int),
            "temperature": _as_float("temperature", self.temperature),
            "top_p": _as_float("top_p", self.top_p),
            "top_k": _as_int("top_k", self.top_k),
            "min_p": _in_range("min_p", self.min_p, 0.0, 1.0),
            "repetition_penalty": _as_float("repetition_penalty", self.repetition_penalty),
            "presence_penalty": _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "logit_bias": _logit_bias(self.logit_bias),
            "seed": None if self.seed is None else _as_int("seed", self.seed),
            "stop": _stop_list(self.stop),
            "stop_token_ids": _id_list("stop_token_ids", self.stop_token_ids),
            "min_tokens": _as_int("min_tokens", self.min_tokens),
            "logprobs": _optional_count("logprobs", self.logprobs),
            "prompt_logprobs": _optional_count("prompt_logprobs", self.prompt_logprobs),
        }
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            v[name] = _as_bool(name, getattr(self, name))
        if v["temperature"] < 0:
            raise _bad("temperature", ">= 0", self.temperature)
        if not 0 < v["top_p"] <= 1:
            raise _bad("top_p", "in (0, 1]", self.top_p)
        if v["top_k"] < -1:
            raise _bad("top_k", "-1 (off), 0 (off) or positive", self.top_k)
        if v["repetition_penalty"] <= 0:
            raise _bad("repetition_penalty", "> 0", self.repetition_penalty)
        if self.max_tokens is not None:
            v["max_tokens"] = _as_int("max_tokens", self.max_tokens)
            if v["max_tokens"] < 1:
                raise _bad("max_tokens", ">= 1 or None", self.max_tokens)
        if v["min_tokens"] < 0:
            raise _bad("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and v["min_tokens"] > v["max_tokens"]:
            raise _bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        return v

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop)

    def replace(self, **changes) -> SamplingParams:
        """A copy with `changes` applied, validated again."""
        return dataclasses.replace(self, **changes)


def stop_token_set(params: SamplingParams, eos_token_ids: Iterable[int]) -> tuple[int, ...]:
    """The token ids that end a sequence: the model's eos (unless ignore_eos) plus the request's."""
    ids = [] if params.ignore_eos else list(eos_token_ids)
    ids += params.stop_token_ids
    return tuple(dict.fromkeys(ids))


def resolve_seed(params: SamplingParams) -> int:
    """The request's seed, or a fresh random 64-bit one when it has none."""
    return params.seed if params.seed is not None else secrets.randbits(64)


# --- Deterministic noise --------------------------------------------------------------------------
#
# All arithmetic is on uint32 (wrap-around). fmix32 is MurmurHash3's finalizer:
#   h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
# Keys (host side, per row):
#   s = seed mod 2**64; words = (s & M, s >> 32, stream & M, step & M, salt & M), M = 0xFFFFFFFF
#   absorb(k, w) = fmix32((k ^ w) * 0x9E3779B1 + 0x7F4A7C15)
#   k1 = fold absorb over words starting from 0x243F6A88; k2 = the same from 0xB7E15162
# Per element i = 0..n-1 (device side):
#   h = fmix32(k1 ^ fmix32(i * 0x9E3779B9 + k2))
#   u = (float32(h >> 9) + 0.5) * 2**-23      (float32, exact: u is in [2**-24, 1 - 2**-24])
# 23 bits, not 24: float32(2**24 - 1) + 0.5 rounds up to 2**24, which would give u == 1 and an
# infinite Gumbel noise. In torch (no uint32 multiply) use int64 and mask with & M after each op.

M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_ABSORB_MUL, _ABSORB_ADD = 0x9E3779B1, 0x7F4A7C15
_IDX_MUL = 0x9E3779B9
_KEY1_INIT, _KEY2_INIT = 0x243F6A88, 0xB7E15162


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer over a uint32 array (wrap-around arithmetic)."""
    h = np.asarray(h, dtype=np.uint32)
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_C1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_C2)
    return h ^ (h >> np.uint32(16))


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * _C1) & M32
    h ^= h >> 13
    h = (h * _C2) & M32
    return h ^ (h >> 16)


def noise_keys(seed: int, stream: int, step: int, salt: int = 0) -> tuple[int, int]:
    """The two uint32 keys of one noise row (see the algorithm comment above)."""
    s = seed & _M64
    words = (s & M32, s >> 32, stream & M32, step & M32, salt & M32)
    keys = []
    for k in (_KEY1_INIT, _KEY2_INIT):
        for w in words:
            k = _fmix32_int(((k ^ w) * _ABSORB_MUL + _ABSORB_ADD) & M32)
        keys.append(k)
    return keys[0], keys[1]


def uniform(seed: int, stream: int, step: int, n: int, salt: int = 0) -> np.ndarray:
    """`n` float32 values in (0, 1), a pure function of (seed, stream, step, salt, index)."""
    k1, k2 = noise_keys(seed, stream, step, salt)
    i = np.arange(n, dtype=np.uint32)
    h = fmix32(np.uint32(k1) ^ fmix32(i * np.uint32(_IDX_MUL) + np.uint32(k2)))
    return ((h >> np.uint32(9)).astype(_F32) + _F32(0.5)) * _F32(2.0**-23)


def gumbel(u: np.ndarray) -> np.ndarray:
    """Gumbel(0, 1) noise from uniforms in (0, 1): -log(-log(u)), float32."""
    return -np.log(-np.log(u))


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

    @property
    def step(self) -> int:
        return len(self.output_token_ids)


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
    """Logit bias, min_tokens, repetition / frequency / presence penalties (vLLM order); float32.

    Token ids outside the vocabulary are ignored.
    """
    p = st.params
    x = np.array(logits, dtype=_F32)
    v = x.shape[-1]
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
    # whose mass reaches top_p. `before[0]` is 0, so at least one token stays.
    n_keep = int(np.count_nonzero(before < _F32(top_p) * c[-1]))
    boundary = x[order[n_keep - 1]]
    return np.where(x >= boundary, x, _NEG_INF)  # ties with the last kept token stay


def filtered_logits(processed: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, then min_p, top_k, top_p (each on what the previous left); masked = -inf.

    For random sampling only (needs temperature >= GREEDY_EPS).
    """
    # True division by a float32 temperature: device code must not multiply by a reciprocal.
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
