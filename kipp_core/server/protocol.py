"""Reading OpenAI request bodies: JSON parsing and typed fields that fail with 400 naming the
parameter, and the sampling fields shared by /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable

from kipp_core.sampling import SamplingParams
from kipp_core.server.errors import bad_request, not_found

# vLLM's sampling extensions, accepted by both endpoints.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
COMMON_FIELDS = ("model", "stream", "stream_options", "user", *SAMPLING_FIELDS)
MAX_CHOICES = 256  # prompts x n in one request


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")  # json.loads would accept NaN and Infinity


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, and ints past Python's digit limit
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:  # a "\ud800" escape decodes to a lone surrogate, which no UTF-8 text can hold
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request body holds an unpaired UTF-16 surrogate escape") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    return body


class Fields:
    """A request body being read; unknown fields and values of the wrong type are 400s."""

    def __init__(self, body: dict, known: Iterable[str], ignored: Iterable[str] = ()):
        self.body = body
        allowed = set(known) | set(ignored)
        for name in body:
            if name not in allowed:
                raise bad_request(f"Unrecognized request argument supplied: {name}", name)

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, default=None):
        v = self.body.get(name)
        return default if v is None else v

    def integer(self, name: str, default=None, lo: int | None = None, hi: int | None = None):
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            v = int(v)  # 5.0 is 5, as pydantic's lax mode reads it
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad_request(f"{name} must be an integer, got {_show(v)}", name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(f"{name} must be in [{lo}, {hi}], got {_show(v)}", name)
        return v

    def number(self, name: str, default=None, lo: float | None = None, hi: float | None = None):
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad_request(f"{name} must be a number, got {_show(v)}", name)
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise bad_request(f"{name} must be finite, got {_show(v)}", name)
        if (lo is not None and f < lo) or (hi is not None and f > hi):
            raise bad_request(f"{name} must be in [{lo}, {hi}], got {_show(v)}", name)
        return f

    def _typed(self, name: str, default, ok, rule: str):
        v = self.body.get(name)
        if v is None:
            return default
        if not ok(v):
            raise bad_request(f"{name} must be {rule}, got {_show(v)}", name)
        return v

    def boolean(self, name: str, default=None):
        return self._typed(name, default, lambda v: isinstance(v, bool), "a boolean")

    def string(self, name: str, default=None):
        return self._typed(name, default, lambda v: isinstance(v, str), "a string")

    def mapping(self, name: str, default=None):
        return self._typed(name, default, lambda v: isinstance(v, dict), "an object")

    def array(self, name: str, default=None):
        return self._typed(name, default, lambda v: isinstance(v, list), "an array")


def _show(v) -> str:
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    s = json.dumps(v) if isinstance(v, str) else repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def stream_flags(f: Fields) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options only with stream, as OpenAI requires."""
    stream = f.boolean("stream", False)
    opts = f.mapping("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    for key in opts:
        if key not in ("include_usage", "include_obfuscation", "continuous_usage_stats"):
            raise bad_request(f"stream_options has an unknown field {key!r}", "stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
    return stream, include


def token_id_list(f: Fields, name: str, vocab_size: int) -> list[int] | None:
    ids = f.array(name)
    if ids is None:
        return None
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad_request(
                f"{name} must hold token ids in [0, {vocab_size}), got {_show(t)}", name
            )
    return ids


def _logit_bias(f: Fields, vocab_size: int) -> dict[int, float] | None:
    bias = f.mapping("logit_bias")
    if bias is None:
        return None
    out = {}
    for k, v in bias.items():
        if not re.fullmatch(r"[0-9]{1,9}", k) or int(k) >= vocab_size:
            raise bad_request(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {_show(k)}",
                "logit_bias",
            )
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {_show(v)}", "logit_bias"
            )
        out[int(k)] = float(v)
    return out


def sampling_fields(f: Fields, vocab_size: int) -> dict:
    """The sampling fields present in the body, type-checked; ranges are left to SamplingParams."""
    kw = {}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        kw[name] = f.number(name)
    for name in ("presence_penalty", "frequency_penalty"):
        kw[name] = f.number(name, lo=-2.0, hi=2.0)
    kw["n"] = f.integer("n", lo=1, hi=MAX_CHOICES)
    kw["top_k"] = f.integer("top_k", lo=-1)
    kw["seed"] = f.integer("seed", lo=-(2**63), hi=2**64 - 1)
    kw["min_tokens"] = f.integer("min_tokens", lo=0)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        kw[name] = f.boolean(name)
    stop = f.raw("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request(
            f"stop must be a string or an array of strings, got {_show(stop)}", "stop"
        )
    kw["stop"] = stop
    kw["stop_token_ids"] = token_id_list(f, "stop_token_ids", vocab_size)
    kw["logit_bias"] = _logit_bias(f, vocab_size)
    return {k: v for k, v in kw.items() if v is not None}


def build_params(
    defaults: SamplingParams, fields: dict, rename: dict[str, str] | None = None
) -> SamplingParams:
    """`defaults` with `fields` applied. SamplingParams' ValueError names the field first; it
    becomes a 400 naming the request parameter (`rename` maps field to parameter)."""
    try:
        return defaults.replace(**fields)
    except ValueError as e:
        msg = str(e)
        name = msg.split(" ", 1)[0]
        param = (rename or {}).get(name, name)
        if param != name:
            msg = param + msg[len(name) :]
        raise bad_request(msg, param) from None


def check_context(
    num_prompt: int,
    max_tokens: int | None,
    limit: int,
    what: str,
    max_param: str = "max_tokens",
    min_tokens: int = 0,
) -> None:
    """400 naming the lengths when the prompt (plus max_tokens) does not fit the context, or
    min_tokens is more than the context leaves after the prompt."""
    if num_prompt < limit and num_prompt + min_tokens > limit:
        raise bad_request(
            f"min_tokens ({min_tokens}) is more than the context of {limit} tokens leaves after "
            f"the {num_prompt} of the {what}",
            "min_tokens",
        )
    if num_prompt >= limit or (max_tokens is not None and num_prompt + max_tokens > limit):
        asked = num_prompt + (max_tokens or 0)
        param = what if num_prompt >= limit else max_param
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{asked} tokens ({num_prompt} in the {what}, {max_tokens or 0} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param,
        )


def check_model(f: Fields, served: Iterable[str]) -> None:
    name = f.string("model")
    if name is not None and name not in served:
        raise not_found(f"The model `{name}` does not exist.", "model", "model_not_found")
