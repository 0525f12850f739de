"""Property-based fuzzing of request bodies against a live server: a valid body with one field made
invalid (wrong type, huge number, out of range), an unknown field, broken UTF-8, or arbitrary JSON.
Each gets a 4xx with an OpenAI error body naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import assert_error_body, wait_idle


def floats(*args, **kw):
    return st.floats(*args, allow_nan=False, allow_infinity=False, **kw)  # JSON has neither


FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

COMPLETION = {"prompt": "hi", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

huge = st.integers(min_value=10**6, max_value=10**40) | st.integers(max_value=-(10**6))
not_number = st.text(max_size=5) | st.booleans() | st.lists(st.integers(), max_size=2) | st.just({})
not_int = not_number | floats().filter(lambda f: not f.is_integer())
not_bool = st.integers() | st.text(max_size=3) | st.just([]) | st.just({"a": 1})
json_leaf = st.none() | st.booleans() | st.integers() | floats() | st.text()
any_json = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)

# field -> values that are never valid for it (both endpoints)
COMMON_BAD = {
    "temperature": not_number | floats(max_value=-1e-6),
    "top_p": not_number | floats(min_value=1.0001, max_value=1e300) | floats(max_value=0),
    "n": not_int | huge | st.integers(max_value=0),
    "seed": not_int | st.integers(min_value=2**64),
    "presence_penalty": not_number | floats(min_value=2.001, max_value=1e300),
    "frequency_penalty": not_number | floats(max_value=-2.001, min_value=-1e300),
    "top_k": not_int | st.integers(max_value=-2),
    "min_p": not_number | floats(min_value=1.001, max_value=1e300),
    "repetition_penalty": not_number | floats(max_value=0),
    "stop": st.integers()
    | st.just({})
    | st.lists(st.integers(), min_size=1)
    | st.just([""])
    | st.lists(st.text(min_size=1), min_size=17, max_size=20),
    "logit_bias": not_bool.filter(lambda v: v != {})
    | st.dictionaries(
        st.text(min_size=1).filter(lambda k: not k.isdigit()), st.integers(), min_size=1
    )
    | st.dictionaries(
        st.sampled_from(["1", "2"]), floats(min_value=100.5, max_value=1e9), min_size=1
    ),
    "stream": not_bool,
    "ignore_eos": not_bool,
    "min_tokens": not_int | st.integers(max_value=-1),
    "stop_token_ids": st.integers() | st.lists(st.text(), min_size=1) | st.lists(huge, min_size=1),
    "stream_options": st.just({"include_usage": True}),  # without stream
    "model": st.integers() | st.text(min_size=1).filter(lambda s: s != "kipp-tiny"),
}
COMPLETION_BAD = {
    **COMMON_BAD,
    "prompt": st.integers()
    | st.booleans()
    | st.just([])
    | st.just("")
    | st.just({})
    | st.lists(st.booleans(), min_size=1)
    | st.lists(huge, min_size=1)
    | st.lists(floats(), min_size=1)
    | st.just([[]]),
    "max_tokens": not_int | st.integers(min_value=4096) | st.integers(max_value=-1),
    "logprobs": not_int | st.integers(min_value=21) | st.integers(max_value=-1),
    "echo": not_bool,
    "suffix": st.text(),
}
CHAT_BAD = {
    **COMMON_BAD,
    "messages": st.just([])
    | st.text()
    | st.lists(st.integers(), min_size=1)
    | st.lists(
        st.fixed_dictionaries(
            {
                "role": st.text().filter(
                    lambda r: r not in ("system", "developer", "user", "assistant", "tool")
                )
            }
        ),
        min_size=1,
    )
    | st.lists(
        st.fixed_dictionaries({"role": st.just("user"), "content": st.integers()}), min_size=1
    ),
    "max_tokens": not_int | st.integers(min_value=4096) | st.integers(max_value=0),
    "max_completion_tokens": not_int | st.integers(min_value=4096) | st.integers(max_value=0),
    "logprobs": not_bool,
    "tools": st.text() | st.lists(st.integers(), min_size=1) | st.just([{"type": "function"}]),
    "tool_choice": st.integers() | st.text().filter(lambda s: s not in ("none", "auto")),
    "response_format": st.text() | st.just({"type": "json_schema"}) | st.just({}),
    "chat_template_kwargs": st.text() | st.just({"enable_thinking": "yes"}) | st.just({"x": 1}),
}
ENDPOINTS = {
    "/v1/completions": (COMPLETION, COMPLETION_BAD),
    "/v1/chat/completions": (CHAT, CHAT_BAD),
}
BROKEN_UTF8 = [
    b"\xff",
    b"\xc3(",
    b"\xa0\xa1",
    b"\xe2\x28\xa1",
    b"\xf0\x28\x8c\xbc",
    b"\xed\xa0\x80",
]


@st.composite
def one_bad_field(draw, bad: dict) -> tuple[str, object]:
    name = draw(st.sampled_from(sorted(bad)))
    return name, draw(bad[name])


@pytest.mark.parametrize("path", list(ENDPOINTS))
@FUZZ
@given(data=st.data())
def test_one_invalid_field_is_a_4xx_naming_it(server, http, path, data):
    valid, bad = ENDPOINTS[path]
    name, value = data.draw(one_bad_field(bad))
    status, _, body = http.post(path, {**valid, name: value})
    assert 400 <= status < 500, (name, value, body)
    err = assert_error_body(body)
    assert err["param"] == name, (name, value, err)


@pytest.mark.parametrize("path", list(ENDPOINTS))
@FUZZ
@given(name=st.text(min_size=1, max_size=12), value=any_json)
def test_unknown_fields_are_rejected(server, http, path, name, value):
    valid, bad = ENDPOINTS[path]
    known = (
        set(bad)
        | set(valid)
        | {
            "user",
            "store",
            "metadata",
            "service_tier",
            "verbosity",
            "prompt_cache_key",
            "prompt_cache_retention",
            "moderation",
            "prompt_cache_options",
            "safety_identifier",
            "modalities",
            "reasoning_effort",
            "parallel_tool_calls",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "best_of",
            "top_logprobs",
            "audio",
            "prediction",
            "web_search_options",
            "functions",
            "function_call",
        }
    )
    if name in known:
        return
    status, _, body = http.post(path, {**valid, name: value})
    assert status == 400 and assert_error_body(body)["param"] == name


@pytest.mark.parametrize("path", list(ENDPOINTS))
@FUZZ
@given(bad=st.sampled_from(BROKEN_UTF8), at=floats(0, 1))
def test_broken_utf8_is_400(server, http, path, bad, at):
    raw = json.dumps(ENDPOINTS[path][0]).encode()
    i = int(at * len(raw))
    status, _, body = http.post(path, raw[:i] + bad + raw[i:])
    assert status == 400 and assert_error_body(body)


@FUZZ
@given(body=any_json, path=st.sampled_from(list(ENDPOINTS)))
def test_arbitrary_json_never_5xx(server, http, body, path):
    status, _, reply = http.post(path, body)
    assert status < 500, reply
    if status >= 400:
        assert_error_body(reply)


def test_still_serving_after_fuzzing(server, http):
    status, _, body = http.post("/v1/completions", {"prompt": "still there?", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    wait_idle(server)
