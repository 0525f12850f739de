"""/v1/messages through the official `anthropic` SDK on known text: conftest.SCRIPTS force what the
random model writes, so the thinking, text and tool_use blocks are derived by hand from the
script text, and a stream must give the same message. Prompts are held to the official chat
template (rendered by jinja2) of the equivalent OpenAI messages through count_tokens. Malformed
bodies get Anthropic's error shape and a 4xx, and the server goes on serving."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.core.chat_references import jinja_render
from tests.server.conftest import Http, wait_idle

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"name": "get_time", "input_schema": {"type": "object"}},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": TOOLS[0]["input_schema"],
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ADAPTIVE = {"type": "adaptive"}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def both(claude, **kw):
    """(the whole message, the stream's final message, the stream's events)."""
    kw = {"model": "kipp-tiny", "max_tokens": 200, **kw}
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    return whole, final, events


def shape(message) -> list[tuple]:
    """The blocks without their ids."""
    out = []
    for b in message.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_") and len(b.id) == 30
            out.append(("tool_use", b.name, b.input))
        else:
            out.append((b.type, b.thinking if b.type == "thinking" else b.text))
    return out


def input_fragments(events) -> dict[int, str]:
    frags: dict[int, list[str]] = {}
    for e in events:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            frags.setdefault(e.index, []).append(e.delta.partial_json)
    return {i: "".join(f) for i, f in frags.items() if len(f) >= 2}


def test_thinking_text_and_tool_use_blocks(claude):
    msgs = user("[[script:think_call]] weather?")
    whole, final, events = both(claude, messages=msgs, tools=TOOLS, thinking=ADAPTIVE)
    want = [
        ("thinking", "The user wants the weather."),
        ("text", "Let me check."),
        ("tool_use", "get_weather", {"city": "Paris", "days": 2}),
    ]
    assert shape(whole) == shape(final) == want
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert [b.signature for b in whole.content if b.type == "thinking"] == [""]
    assert json.loads(input_fragments(events)[2]) == {"city": "Paris", "days": 2}


def test_two_tool_uses_each_stream_their_json(claude):
    whole, final, events = both(claude, messages=user("[[script:two_calls]]"), tools=TOOLS)
    want = [("tool_use", "get_weather", {"city": "Oslo"}), ("tool_use", "get_time", {"tz": "UTC"})]
    assert shape(whole) == shape(final) == want
    frags = input_fragments(events)
    assert [json.loads(frags[i]) for i in (0, 1)] == [b[2] for b in want]


def test_stop_sequence(claude):
    kw = dict(messages=user("[[script:think_only]]"), thinking=ADAPTIVE, stop_sequences=["is 4"])
    whole, final, _ = both(claude, **kw)
    assert shape(whole) == shape(final) == [("thinking", "Just thinking."), ("text", "The answer ")]
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "is 4")
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "is 4")


def test_end_turn_and_an_omitted_thinking_display(claude):
    thinking = {"type": "enabled", "budget_tokens": 64, "display": "omitted"}
    whole, final, _ = both(claude, messages=user("[[script:think_only]]"), thinking=thinking)
    assert shape(whole) == shape(final) == [("thinking", ""), ("text", "The answer is 4.")]
    assert whole.stop_reason == "end_turn"


def test_tool_choice_none_offers_no_tools(claude, tok):
    msgs = user("[[script:two_calls]]")
    whole, _, _ = both(claude, messages=msgs, tools=TOOLS, tool_choice={"type": "none"})
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason == "end_turn"
    assert whole.content[0].text.startswith("<tool_call>")
    n = claude.messages.count_tokens(
        model="kipp-tiny", messages=msgs, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert n.input_tokens == len(tok.encode(jinja_render(msgs, None, True, False)))


CONVERSATIONS = {
    "system blocks and two text blocks": (
        {
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
                }
            ],
        },
        [{"role": "system", "content": "Be brief.\nBe kind."}, *user("Hi\nthere")],
    ),
    "a thought, a tool use and its result": (
        {
            "tools": TOOLS,
            "thinking": ADAPTIVE,
            "messages": [
                *user("Weather in Oslo?"),
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "-3C"}],
                        },
                    ],
                },
            ],
        },
        [
            *user("Weather in Oslo?"),
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Need the tool.",  # kept: no user query after it
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    }
                ],
            },
            {"role": "tool", "content": "-3C"},
        ],
    ),
    "text after a tool result": (
        {
            "messages": [
                *user("Time?"),
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "get_time", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": "noon"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        },
        [
            *user("Time?"),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_time", "arguments": {}}}
                ],
            },
            {"role": "tool", "content": "noon"},
            *user("And tomorrow?"),
        ],
    ),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_conversations_render_as_the_official_template(claude, tok, name):
    body, chat = CONVERSATIONS[name]
    n = claude.messages.count_tokens(model="kipp-tiny", **body)
    think = "thinking" in body
    tools = CHAT_TOOLS if "tools" in body else None
    assert n.input_tokens == len(tok.encode(jinja_render(chat, tools, True, think)))


def test_an_assistant_prefill_is_continued(claude, tok):
    msgs = [*user("Count to three."), {"role": "assistant", "content": "One, two,"}]
    n = claude.messages.count_tokens(model="kipp-tiny", messages=msgs, thinking=ADAPTIVE)
    want = jinja_render(msgs[:1], None, True, False) + "One, two,"
    assert n.input_tokens == len(tok.encode(want))
    m = claude.messages.create(model="kipp-tiny", max_tokens=3, messages=msgs, thinking=ADAPTIVE)
    assert [b.type for b in m.content] == ["text"] and m.usage.output_tokens == 3


def test_x_api_key_and_bearer_both_authenticate(tiny_path):
    from kipp_core.server.context import ServerConfig
    from tests.server.conftest import start_server

    st = start_server(tiny_path, ServerConfig(port=0, api_key="k1"))
    try:
        ok = anthropic.Anthropic(base_url=st.url, api_key="k1", max_retries=0)
        assert ok.messages.count_tokens(model="kipp-tiny", messages=user("hi")).input_tokens > 0
        bearer = anthropic.Anthropic(base_url=st.url, auth_token="k1", max_retries=0)
        assert bearer.messages.count_tokens(model="kipp-tiny", messages=user("hi")).input_tokens
        http = Http(st.url)
        status, _, body = http.post("/v1/models", None, {"x-api-key": "k1"})
        assert status == 405  # authenticated, then the wrong method
        for headers in ({"x-api-key": "k2"}, {}, {"x-api-key": "k1", "Authorization": "Bearer k2"}):
            status, _, body = http.post("/v1/messages/count_tokens", {}, headers)
            assert status == 401 and body["error"]["type"] == "authentication_error", body
            status, _, body = http.post("/v1/responses", {}, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        http.close()
    finally:
        st.stop()


VALID = {"model": "kipp-tiny", "max_tokens": 2, "messages": user("hi")}
TEXT = {"type": "text", "text": "x"}
IMAGE = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
BAD = {
    "no max_tokens": {"model": "kipp-tiny", "messages": user("hi")},
    "max_tokens 0": {**VALID, "max_tokens": 0},
    "max_tokens past the context": {**VALID, "max_tokens": 10**6},
    "no messages": {**VALID, "messages": []},
    "messages not an array": {**VALID, "messages": "hi"},
    "a system role": {**VALID, "messages": [{"role": "system", "content": "hi"}]},
    "content a number": {**VALID, "messages": [{"role": "user", "content": 5}]},
    "a block without a type": {**VALID, "messages": [{"role": "user", "content": [{}]}]},
    "an image": {**VALID, "messages": [{"role": "user", "content": [IMAGE]}]},
    "an image tool result": {
        **VALID,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}],
            }
        ],
    },
    "a tool_use without input": {
        **VALID,
        "messages": [
            *user("hi"),
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
            *user("ok"),
        ],
    },
    "text a number": {**VALID, "messages": [{"role": "user", "content": [{**TEXT, "text": 1}]}]},
    "a system image": {**VALID, "system": [IMAGE]},
    "a server tool": {**VALID, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    "a tool without a name": {**VALID, "tools": [{"name": "", "input_schema": {}}]},
    "a tool without a schema": {**VALID, "tools": [{"name": "f"}]},
    "a schema that does not compile": {
        **VALID,
        "tools": [{"name": "f", "input_schema": {"$ref": "http://x/y"}}],
        "tool_choice": {"type": "any"},
    },
    "tool_choice names no tool": {
        **VALID,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "nope"},
    },
    "tool_choice any without tools": {**VALID, "tool_choice": {"type": "any"}},
    "tool_choice of no type": {**VALID, "tools": TOOLS, "tool_choice": {"type": "bogus"}},
    "thinking without a budget": {**VALID, "thinking": {"type": "enabled"}},
    "thinking with a budget of 0": {**VALID, "thinking": {"type": "enabled", "budget_tokens": 0}},
    "thinking of no type": {**VALID, "thinking": {"type": "on"}},
    "a format that is not a schema": {**VALID, "output_config": {"format": {"type": "json"}}},
    "a format schema that does not compile": {
        **VALID,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "tuple"}}},
    },
    "a format with forced tools": {
        **VALID,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    },
    "an effort of no level": {**VALID, "output_config": {"effort": "extreme"}},
    "temperature above 1": {**VALID, "temperature": 1.5},
    "top_k below 0": {**VALID, "top_k": -1},
    "an empty stop sequence": {**VALID, "stop_sequences": [""]},
    "stream not a boolean": {**VALID, "stream": "yes"},
    "an unknown field": {**VALID, "foo": 1},
    "a container": {**VALID, "container": "c1"},
}


def assert_anthropic_error(body, kind: str = "invalid_request_error") -> None:
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    msg = body["error"]["message"]
    assert isinstance(msg, str) and msg and "Traceback" not in msg


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_messages_get_anthropics_error(server, http, name):
    status, _, body = http.post("/v1/messages", BAD[name])
    assert status == 400, body
    assert_anthropic_error(body)
    status, _, body = http.post("/v1/messages", {**VALID, "stream": True})
    assert status == 200  # the server goes on serving


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "kind"),
    [
        ("POST", "/v1/messages", {**VALID, "model": "nope"}, 404, "not_found_error"),
        ("POST", "/v1/messages/count_tokens", {**VALID}, 400, "invalid_request_error"),
        ("POST", "/v1/messages/nope", VALID, 404, "not_found_error"),
        ("GET", "/v1/messages", None, 405, "invalid_request_error"),
        ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error"),
        ("POST", "/v1/messages", b"\xff", 400, "invalid_request_error"),
    ],
)
def test_http_errors_have_anthropics_shape(server, http, method, path, body, status, kind):
    got, _, answer = http.request(method, path, body)
    assert got == status, answer
    assert_anthropic_error(answer, kind)
    wait_idle(server)


def test_an_engine_failure_is_anthropics_error_whole_and_streamed(server, claude, http):
    status, _, body = http.post("/v1/messages", {**VALID, "messages": user("[[fail]]")})
    assert status == 500
    assert_anthropic_error(body, "api_error")
    assert "engine failed" in body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as e:  # an error event, then the stream ends
        with claude.messages.stream(
            model="kipp-tiny", max_tokens=4, messages=user("[[fail]]")
        ) as s:
            list(s)
    assert e.value.body["error"]["type"] == "api_error"
    wait_idle(server)
    m = claude.messages.create(model="kipp-tiny", max_tokens=2, messages=user("fine"))
    assert m.stop_reason in ("max_tokens", "end_turn")
