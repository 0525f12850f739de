"""SamplingParams: how to sample one request, with vLLM / OpenAI semantics, validated on
construction (a ValueError names the field and the value)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kipp_core.structured_outputs import StructuredOutputs

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# The samplers compute in float32: x / temperature, x / rp and x * rp. A float32 temperature of
# inf makes -inf / inf = NaN; a repetition penalty of 0 or inf makes -inf * 0 or 0 * inf = NaN.
# Within these bounds a processed logit can overflow to +-inf but never become NaN.
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


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
    context limit. `structured_outputs` holds the output to JSON, a JSON schema or a tool call
    (kipp_core/structured_outputs.py). `thinking_token_budget` closes a thought after that many
    tokens (kipp_core/thinking_budget.py). Invalid values raise `ValueError` naming the field.
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
    structured_outputs: StructuredOutputs | None = None  # kipp_core/structured_outputs.py
    thinking_token_budget: int | None = None  # kipp_core/thinking_budget.py

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
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise _bad("structured_outputs", "a StructuredOutputs or None", so)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            v[name] = _as_bool(name, getattr(self, name))
        if v["temperature"] < 0:
            raise _bad("temperature", ">= 0", self.temperature)
        with np.errstate(over="ignore"):  # a value past float32's range is refused below
            t32, rp32 = np.float32(v["temperature"]), np.float32(v["repetition_penalty"])
        if np.isinf(t32):
            raise _bad(
                "temperature", f"at most {F32_MAX:.8g} (it runs in float32)", self.temperature
            )
        if not 0 < v["top_p"] <= 1:
            raise _bad("top_p", "in (0, 1]", self.top_p)
        if v["top_k"] < -1:
            raise _bad("top_k", "-1 (off), 0 (off) or positive", self.top_k)
        if not F32_TINY <= rp32 <= F32_MAX:  # also > 0: 0 and subnormals are below TINY
            raise _bad(
                "repetition_penalty",
                f"in [{F32_TINY:.8g}, {F32_MAX:.8g}] (it runs in float32)",
                self.repetition_penalty,
            )
        if self.max_tokens is not None:
            v["max_tokens"] = _as_int("max_tokens", self.max_tokens)
            if v["max_tokens"] < 1:
                raise _bad("max_tokens", ">= 1 or None", self.max_tokens)
        budget = self.thinking_token_budget
        if budget is not None:
            v["thinking_token_budget"] = _as_int("thinking_token_budget", budget)
            if v["thinking_token_budget"] < 0:
                raise _bad("thinking_token_budget", ">= 0 or None", budget)
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
