"""Property-based fuzzing of /v1/messages, /v1/messages/count_tokens and /v1/responses: a valid
body that uses every part of the API (blocks, items, tools, thinking, formats) with one value
anywhere in it replaced by arbitrary JSON, and arbitrary JSON bodies. None gets a 5xx: each is
answered with a 200, or a 4xx in its API's error shape, and the server keeps serving."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.server.conftest import assert_error_body, wait_idle
from tests.server.test_fuzz import any_json

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "t", "signature": ""},
            {"type": "text", "text": "x"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r"}]}
        ],
    },
]
COUNT = {
    "model": "kipp-tiny",
    "system": [{"type": "text", "text": "s"}],
    "messages": CONVERSATION,
    "tools": [{"name": "f", "description": "d", "input_schema": TOOL_SCHEMA}],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 1},
    "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": TOOL_SCHEMA}},
}
MESSAGES = {
    **COUNT,
    "max_tokens": 2,
    "stop_sequences": ["x"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "metadata": {"user_id": "u"},
}
RESPONSES = {
    "model": "kipp-tiny",
    "max_output_tokens": 2,
    "instructions": "i",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "type": "reasoning",
            "id": "r",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "t"}],
        },
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "r"},
    ],
    "tools": [{"type": "function", "name": "f", "parameters": TOOL_SCHEMA}],
    "tool_choice": "auto",
    "text": {"format": {"type": "json_schema", "name": "x", "schema": TOOL_SCHEMA}},
    "reasoning": {"effort": "low"},
    "temperature": 0.5,
    "top_p": 0.9,
    "metadata": {},
    "include": [],
    "truncation": "disabled",
    "parallel_tool_calls": True,
}
BODIES = {
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT,
    "/v1/responses": RESPONSES,
    "/v1/messages stream": {**MESSAGES, "stream": True},
    "/v1/responses stream": {**RESPONSES, "stream": True},
}
LENGTHS = ("max_tokens", "max_output_tokens", "budget_tokens")  # kept short: the test is fast


def paths(value, prefix=()) -> list[tuple]:
    """Every place a value sits in a JSON document."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


def replaced(body: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def post(http, name: str, body):
    return http.post(name.split()[0], body)


def check_answer(path: str, status: int, body) -> None:
    assert status < 500, (status, body)
    if status < 400:
        return
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert "Traceback" not in body["error"]["message"]
    else:
        assert_error_body(body)


@pytest.mark.parametrize("path", list(BODIES))
def test_the_valid_bodies_are_served(server, http, path):
    status, _, body = post(http, path, BODIES[path])
    assert status == 200, body


@pytest.mark.parametrize("path", list(BODIES))
@FUZZ
@given(data=st.data())
def test_one_value_anywhere_replaced_is_never_5xx(server, http, path, data):
    valid = BODIES[path]
    where = data.draw(st.sampled_from(paths(valid)))
    value = data.draw(any_json)
    big = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 16
    unbounded = value is None and where[-1] == "max_output_tokens"  # the rest of the context
    assume(not (where[-1] in LENGTHS and (big or unbounded)))
    status, _, body = post(http, path, replaced(valid, where, value))
    check_answer(path, status, body)


@pytest.mark.parametrize("path", list(BODIES)[:3])
@FUZZ
@given(body=any_json)
def test_arbitrary_json_is_never_5xx(server, http, path, body):
    status, _, answer = post(http, path, body)
    check_answer(path, status, answer)


@pytest.mark.parametrize("path", list(BODIES))
def test_the_server_still_serves(server, http, path):
    status, _, body = post(http, path, BODIES[path])
    assert status == 200, body
    wait_idle(server)
