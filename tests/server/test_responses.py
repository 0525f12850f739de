"""/v1/responses through the official `openai` SDK on known text: conftest.SCRIPTS force what the
random model writes, so the reasoning, message and function_call items are derived by hand from
the script text, and a stream must end with the same response. Input items are held to the
official chat template (rendered by jinja2) of the equivalent chat messages through
usage.input_tokens. Malformed bodies, and the ones that need stored state, get OpenAI's error
body and a 4xx, and the server goes on serving."""

from __future__ import annotations

import json

import openai
import pytest

from tests.core.chat_references import jinja_render
from tests.server.conftest import assert_error_body, wait_idle

FUNCTIONS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in f.items() if k != "type"}} for f in FUNCTIONS
]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def shape(response) -> list[tuple]:
    """The output items without their ids."""
    out = []
    for i in response.output:
        if i.type == "function_call":
            assert i.id.startswith("fc_") and i.call_id.startswith("call_")
            out.append(("function_call", i.name, json.loads(i.arguments)))
        elif i.type == "reasoning":
            assert i.id.startswith("rs_")
            out.append(("reasoning", "".join(c.text for c in i.content)))
        else:
            assert i.id.startswith("msg_") and i.role == "assistant"
            out.append(("message", "".join(c.text for c in i.content)))
    return out


def both(oai, **kw):
    """(the whole response, the stream's final response, the stream's events)."""
    kw = {"model": "kipp-tiny", "max_output_tokens": 200, **kw}
    whole = oai.responses.create(**kw)
    with oai.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    return whole, final, events


def test_reasoning_message_and_function_call_items(oai):
    whole, final, events = both(oai, input="[[script:think_call]] weather?", tools=FUNCTIONS)
    want = [
        ("reasoning", "The user wants the weather."),
        ("message", "Let me check."),
        ("function_call", "get_weather", {"city": "Paris", "days": 2}),
    ]
    assert shape(whole) == shape(final) == want
    assert whole.status == final.status == "completed"
    assert whole.output_text == "Let me check."
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [call] = [i for i in final.output if i.type == "function_call"]
    assert len(fragments) >= 2 and "".join(fragments) == call.arguments
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")


def test_two_function_calls(oai):
    whole, final, _ = both(oai, input="[[script:two_calls]]", tools=FUNCTIONS)
    want = [
        ("function_call", "get_weather", {"city": "Oslo"}),
        ("function_call", "get_time", {"tz": "UTC"}),
    ]
    assert shape(whole) == shape(final) == want


def test_reasoning_tokens_are_the_thought_with_its_close(oai, tok):
    r = oai.responses.create(model="kipp-tiny", input="[[script:think_only]]")
    want = tok.encode("<think>\nJust thinking.\n</think>")
    assert r.usage.output_tokens_details.reasoning_tokens == len(want)
    assert shape(r) == [("reasoning", "Just thinking."), ("message", "The answer is 4.")]


INPUTS = {
    "instructions and a string": (
        {"instructions": "Be brief.", "input": "Hi"},
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    ),
    "parts, a call, its output and a reasoning item": (
        {
            "tools": FUNCTIONS,
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Need the tool."}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "-3C"},
            ],
        },
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Need the tool.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "content": "-3C"},
        ],
    ),
    "an assistant message, then a user one": (
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hello."}],
                },
                {"role": "user", "content": "Bye"},
            ]
        },
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ),
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_inputs_render_as_the_official_template(oai, tok, name):
    body, chat = INPUTS[name]
    r = oai.responses.create(model="kipp-tiny", max_output_tokens=1, **body)
    tools = CHAT_TOOLS if "tools" in body else None
    assert r.usage.input_tokens == len(tok.encode(jinja_render(chat, tools, True, True)))


def test_effort_none_renders_the_empty_thought(oai, tok):
    r = oai.responses.create(
        model="kipp-tiny", input="Hi", max_output_tokens=1, reasoning={"effort": "none"}
    )
    chat = [{"role": "user", "content": "Hi"}]
    assert r.usage.input_tokens == len(tok.encode(jinja_render(chat, None, True, False)))
    assert r.reasoning.effort == "none" and r.store is False


VALID = {"model": "kipp-tiny", "input": "hi", "max_output_tokens": 2}
BAD = {
    "previous_response_id": {**VALID, "previous_response_id": "resp_1"},
    "store": {**VALID, "store": True},
    "background": {**VALID, "background": True},
    "conversation": {**VALID, "conversation": "conv_1"},
    "prompt": {**VALID, "prompt": {"id": "pmpt_1"}},
    "input": {**VALID, "input": []},
    "an item reference": {**VALID, "input": [{"type": "item_reference", "id": "msg_1"}]},
    "an image part": {
        **VALID,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
    },
    "a role": {**VALID, "input": [{"role": "tool", "content": "x"}]},
    "a call without arguments": {
        **VALID,
        "input": [{"type": "function_call", "call_id": "c", "name": "f"}],
    },
    "a web search tool": {**VALID, "tools": [{"type": "web_search"}]},
    "a tool without a name": {**VALID, "tools": [{"type": "function", "name": ""}]},
    "tool_choice names no tool": {
        **VALID,
        "tools": FUNCTIONS,
        "tool_choice": {"type": "function", "name": "nope"},
    },
    "tool_choice required without tools": {**VALID, "tool_choice": "required"},
    "tool_choice of no shape": {**VALID, "tools": FUNCTIONS, "tool_choice": {"type": "mcp"}},
    "a text format of no type": {**VALID, "text": {"format": {"type": "yaml"}}},
    "a json_schema without a name": {
        **VALID,
        "text": {"format": {"type": "json_schema", "schema": {}}},
    },
    "a schema that does not compile": {
        **VALID,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "tuple"}}},
    },
    "an effort of no level": {**VALID, "reasoning": {"effort": "extreme"}},
    "temperature above 2": {**VALID, "temperature": 2.5},
    "max_output_tokens 0": {**VALID, "max_output_tokens": 0},
    "stream_options without stream": {**VALID, "stream_options": {"include_usage": True}},
    "an unknown field": {**VALID, "foo": 1},
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_responses_get_openais_error(server, http, name):
    status, _, body = http.post("/v1/responses", BAD[name])
    assert status == 400, body
    err = assert_error_body(body)
    assert err["type"] == "invalid_request_error"
    if name in ("previous_response_id", "store", "background", "conversation", "prompt"):
        assert err["param"] == name and "keeps no responses" in err["message"]
    status, _, _ = http.post("/v1/responses", {**VALID, "stream": True})
    assert status == 200  # the server goes on serving
    wait_idle(server)


def test_an_engine_failure_fails_the_response(server, oai, http):
    status, _, body = http.post("/v1/responses", {**VALID, "input": "[[fail]]"})
    assert status == 500 and "engine failed" in assert_error_body(body)["message"]
    events = list(oai.responses.create(model="kipp-tiny", input="[[fail]]", stream=True))
    assert [e.type for e in events][-1] == "response.failed"
    assert events[-1].response.status == "failed"
    assert "engine failed" in events[-1].response.error.message
    wait_idle(server)
    r = oai.responses.create(model="kipp-tiny", input="fine", max_output_tokens=2)
    assert r.status == "incomplete"
