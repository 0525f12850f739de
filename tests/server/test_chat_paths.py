"""Reasoning, tool calls and json_object end to end through the official client. The tool-call and
reasoning outputs are forced (conftest.SCRIPTS), so the expectations are derived by hand from the
script text; streaming is checked against non-streaming and both against those expectations."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kipp_core.chat import render
from kipp_core.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def collect(chunks) -> dict:
    """Fold a chat stream into {content, reasoning, calls: {index: [id, name, args]}, finish}."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "arg_deltas": {}}
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, [None, None, ""])
                if tc.id:
                    assert call[0] is None and tc.type == "function"
                    call[0], call[1] = tc.id, tc.function.name
                call[2] += tc.function.arguments or ""
                out["arg_deltas"].setdefault(tc.index, []).append(tc.function.arguments or "")
            out["finish"] = c.finish_reason or out["finish"]
    return out


def both(client, **kw):
    whole = client.chat.completions.create(model="kipp-tiny", **kw)
    stream = collect(client.chat.completions.create(model="kipp-tiny", stream=True, **kw))
    return whole.choices[0], stream


def test_reasoning_and_tool_call(client):
    whole, stream = both(client, messages=user("[[script:think_call]] weather?"), tools=TOOLS)
    msg = whole.message
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert msg.content == "Let me check."
    [call] = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert whole.finish_reason == "tool_calls"
    assert stream["reasoning"] == "The user wants the weather."
    assert stream["content"] == "Let me check." and stream["finish"] == "tool_calls"
    [(sid, name, args)] = stream["calls"].values()
    assert sid.startswith("call_") and name == "get_weather"
    assert args == call.function.arguments  # the deltas concatenate to the same JSON text


def test_two_calls_and_their_argument_deltas(client):
    whole, stream = both(client, messages=user("[[script:two_calls]]"), tools=TOOLS)
    assert whole.message.content is None
    names = [c.function.name for c in whole.message.tool_calls]
    assert names == ["get_weather", "get_time"]
    assert [v[1] for _, v in sorted(stream["calls"].items())] == names
    for i, c in enumerate(whole.message.tool_calls):
        assert stream["calls"][i][2] == c.function.arguments
        json.loads("".join(stream["arg_deltas"][i]))


def test_tool_choice_none_offers_no_tools_and_parses_nothing(client, tok):
    messages = user("[[script:two_calls]]")
    whole, stream = both(
        client,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert whole.message.content.startswith("<tool_call>")
    assert stream["content"] == whole.message.content and not stream["calls"]
    r = client.chat.completions.create(
        model="kipp-tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.usage.prompt_tokens == len(tok.encode(render(messages, None, True, False)))


def test_named_tool_choice_forces_the_call(client, tok):
    """A named function: the prompt forces the call's opening and the masks hold the rest to one
    JSON object and the close, so even the random model (biased to "}" to finish sooner) returns
    exactly that call, through both paths, as vLLM's guided decoding does."""
    messages = user("what now?")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    bias = {str(tok.encode("}")[0]): 100}
    for seed in range(2):
        whole, stream = both(
            client,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=60,
            logit_bias=bias,
            seed=seed,
        )
        [call] = whole.message.tool_calls
        assert call.function.name == "get_weather" and not whole.message.content
        assert isinstance(json.loads(call.function.arguments), dict)
        assert whole.finish_reason == "tool_calls" and stream["finish"] == "tool_calls"
        assert [v[1:] for v in stream["calls"].values()] == [
            ["get_weather", call.function.arguments]
        ]
    r = client.chat.completions.create(
        model="kipp-tiny", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=1
    )
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert r.usage.prompt_tokens == len(tok.encode(render(messages, TOOLS, True, False) + prefix))


def test_required_tool_choice_makes_one_valid_call(client, tok):
    """tool_choice "required": the random model, biased (+100) to "}" so that its arguments close,
    writes exactly one call of an offered tool, in JSON, through both paths."""
    messages = user("what now?")
    bias = {str(tok.encode("}")[0]): 100}
    kw = dict(
        messages=messages, tools=TOOLS, tool_choice="required", max_tokens=60, logit_bias=bias
    )
    names = set()
    for seed in range(3):
        whole, stream = both(client, seed=seed, **kw)
        [call] = whole.message.tool_calls
        assert isinstance(json.loads(call.function.arguments), dict)
        assert not whole.message.content
        assert whole.finish_reason == "tool_calls" and stream["finish"] == "tool_calls"
        assert [v[1:] for v in stream["calls"].values()] == [
            [call.function.name, call.function.arguments]
        ]
        names.add(call.function.name)
    assert names <= {"get_weather", "get_time"}
    r = client.chat.completions.create(
        model="kipp-tiny", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=1
    )
    want = render(messages, TOOLS, True, False) + "<tool_call>\n"
    assert r.usage.prompt_tokens == len(tok.encode(want))


def test_invalid_call_stays_content(client):
    whole, stream = both(client, messages=user("[[script:bad_call]]"), tools=TOOLS)
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert whole.message.content == (
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call> done'
    )
    assert stream["content"] == whole.message.content and not stream["calls"]


def test_thinking_disabled_leaves_text_whole(client):
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    whole, stream = both(client, messages=user("[[script:think_only]]"), extra_body=kw)
    assert whole.message.content == "<think>\nJust thinking.\n</think>\n\nThe answer is 4."
    assert "reasoning_content" not in whole.message.model_extra
    assert stream["content"] == whole.message.content and stream["reasoning"] == ""
    whole, stream = both(client, messages=user("[[script:think_only]]"))
    assert whole.message.model_extra["reasoning_content"] == "Just thinking."
    assert whole.message.content == "The answer is 4." == stream["content"]


def test_json_object_is_valid_json(client, tok):
    """The model is biased (+100) to <|im_end|> and a few JSON characters: unconstrained it writes
    no JSON object; constrained, a whole object comes first. Sampled runs must parse when they
    stop."""
    bias = {str(tok.encode(s)[0]): 100 for s in ('"', "}", ":")}
    bias["151645"] = 100
    kw = dict(
        messages=user("json please"),
        max_tokens=30,
        logit_bias=bias,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    free = client.chat.completions.create(model="kipp-tiny", seed=0, **kw).choices[0]
    with pytest.raises(ValueError):  # unconstrained, the biased model writes no JSON object
        assert isinstance(json.loads(free.message.content), dict)
    whole, stream = both(client, response_format={"type": "json_object"}, seed=0, **kw)
    assert isinstance(json.loads(whole.message.content), dict) and whole.finish_reason == "stop"
    assert stream["content"] == whole.message.content
    stopped = 0
    for seed in range(3):
        r = client.chat.completions.create(
            model="kipp-tiny",
            response_format={"type": "json_object"},
            seed=seed,
            temperature=1.0,
            **{**kw, "logit_bias": {k: 6 for k in bias}, "max_tokens": 40},
        )
        c = r.choices[0]
        if c.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(c.message.content), dict)
    assert stopped >= 1


def test_json_object_with_thinking_starts_after_think_end(client):
    """Thinking on: the reasoning is free (here forced by the script) up to </think>; from there
    the mask decides (the scripted backend does not see those steps), so the content opens an
    object at once instead of the script's blank lines."""
    r = client.chat.completions.create(
        model="kipp-tiny",
        messages=user("[[script:think_only]]"),
        response_format={"type": "json_object"},
        max_tokens=12,
    )
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Just thinking."
    assert msg.content.lstrip(" ").startswith("{")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": "required", "tools": TOOLS, "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                "tools": TOOLS,
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        # OpenAI's 400 (a message without content once generated to the end of the context)
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "assistant"}]},
            "messages[1].content",
        ),
        ({"messages": [{"role": "tool", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_chat_parameters_name_the_parameter(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:  # extra_body overrides what it names
        client.chat.completions.create(model="kipp-tiny", messages=user("hi"), extra_body=body)
    assert e.value.body["param"] == param


STRICT_TOOL = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "nights": {"type": "integer"},
                "view": {"enum": ["sea", "park"]},
            },
            "required": ["city", "nights", "view"],
            "additionalProperties": False,
        },
    },
}


def closing_bias(tok) -> dict:
    # the random model closes each string as soon as it opens (keys come from the masks)
    return {str(tok.encode('"')[0]): 100}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_forced_tool_call_arguments_follow_the_parameters_schema(client, tok, choice):
    """A forced call's arguments are held to the tool's parameters: every required key, keys
    only from properties, an integer, an enum member; the jsonschema package checks them."""
    for seed in range(2):
        whole, stream = both(
            client,
            messages=user("book it"),
            tools=[STRICT_TOOL, *TOOLS],
            tool_choice=choice,
            max_tokens=120,
            logit_bias=closing_bias(tok),
            seed=seed,
        )
        [call] = whole.message.tool_calls
        if choice != "required":
            assert call.function.name == "book"
        params = {t["function"]["name"]: t["function"]["parameters"] for t in [STRICT_TOOL, *TOOLS]}
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        assert [v[1:] for v in stream["calls"].values()] == [
            [call.function.name, call.function.arguments]
        ]


def test_json_schema_response_format(client, tok):
    """response_format json_schema: the answer is a document the jsonschema package validates,
    through both paths; a schema outside the subset is a 400 naming response_format."""
    schema = STRICT_TOOL["function"]["parameters"]
    fmt = {"type": "json_schema", "json_schema": {"name": "booking", "schema": schema}}
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    for seed in range(2):
        whole, stream = both(
            client,
            messages=user("book it"),
            response_format=fmt,
            max_tokens=120,
            logit_bias=closing_bias(tok),
            seed=seed,
            extra_body=kw,
        )
        jsonschema.validate(json.loads(whole.message.content), schema)
        assert stream["content"] == whole.message.content and whole.finish_reason == "stop"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "tuple"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="kipp-tiny", messages=user("x"), response_format=bad)
    assert e.value.body["param"] == "response_format" and "tuple" in e.value.body["message"]
