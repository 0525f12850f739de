"""Messages and Responses through the official `anthropic` and `openai` SDKs, against the server
in-process and against a real `kipp serve` (its engine in a process of its own), both over
kipp-tiny with Thinking-2507's template, whose prompt opens the thought: so the random model
thinks from the first token, the thinking budget is what closes it, and the answer follows.

The references are outside the front ends: the official template rendered by jinja2 for prompts
and token counts, and, for the text, the offline engine's greedy tokens without any budget, run
in two parts: the thought's first N tokens, then the continuation of the prompt plus those plus
`\\n</think>\\n\\n`. Thinking is what precedes `</think>` (trimmed as the template renders it),
text what follows: neither may hold any of the other, streamed or not, with the thinking on
(`adaptive`: the server's --thinking-budget), off and budgeted. Structured output and forced
tool calls make the random model's answers well-formed where a test needs them to be."""

from __future__ import annotations

import asyncio
import enum
import json
import signal

import anthropic
import openai
import pytest
from pydantic import BaseModel

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.server.context import ServerConfig
from kipp_core.server.server import APIServer, ServerThread
from kipp_core.thinking_budget import CLOSING
from kipp_core.vocab import chat_template
from tests.core.chat_references import jinja_render
from tests.server.conftest import kipp_serve, with_template

TEMPLATE = "qwen3-thinking-2507"
BUDGET = 4  # the server's --thinking-budget
KEY = "sk-agent"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": SCHEMA}
FUNCTION = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": SCHEMA,
}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in FUNCTION.items() if k != "type"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0}  # a field the 2026 anthropic SDK has no argument for


class Unit(str, enum.Enum):
    C = "C"
    F = "F"


class Reading(BaseModel):
    unit: Unit
    ok: bool


@pytest.fixture(scope="module")
def model_dir(tiny_path, tmp_path_factory):
    return with_template(tiny_path, tmp_path_factory.mktemp("thinking"), chat_template(TEMPLATE))


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), backend="oracle")


@pytest.fixture(scope="module", params=["in-process", "kipp-serve"])
def url(request, model_dir):
    if request.param == "in-process":
        config = ServerConfig(port=0, api_key=KEY, default_thinking_budget=BUDGET)
        llm = LLM(str(model_dir), backend="oracle")
        st = ServerThread(APIServer(config, llm=llm, model_name="kipp-tiny")).start()
        yield st.url
        st.stop()
        return
    args = ("--api-key", KEY, "--served-model-name", "kipp-tiny", "--no-access-log")
    proc, url, _ = kipp_serve(*args, "--thinking-budget", str(BUDGET), model=str(model_dir))
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


@pytest.fixture(scope="module")
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def prompt_ids(offline, messages, tools=None) -> list[int]:
    return offline.tokenizer.encode(jinja_render(messages, tools, True, True, TEMPLATE))


def expected(offline, messages, budget: int | None, max_tokens: int) -> tuple[str, str]:
    """(thinking, text) of a greedy answer whose thought is closed after `budget` tokens."""
    tok = offline.tokenizer
    ids = prompt_ids(offline, messages)

    def greedy(prompt, n) -> list[int]:
        out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0]
        return list(out.token_ids)

    if budget is None or budget >= max_tokens:
        out = greedy(ids, max_tokens)
    else:
        out = greedy(ids, budget) if budget else []
        assert len(out) == budget and tok.token_to_id("</think>") not in out
        out += tok.encode(CLOSING)[: max_tokens - budget]
        if len(out) < max_tokens:
            out += greedy(ids + out, max_tokens - len(out))
    thinking, _, answer = tok.decode(out).partition("</think>")
    return thinking.strip("\n"), answer.lstrip("\n")


def blocks(message) -> dict[str, str]:
    kinds = [b.type for b in message.content]
    assert kinds in (["thinking", "text"], ["thinking"], ["text"]), kinds
    return {b.type: b.thinking if b.type == "thinking" else b.text for b in message.content}


# -- Messages ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("thinking", "budget"),
    [({"type": "enabled", "budget_tokens": 3}, 3), ({"type": "adaptive"}, BUDGET), (None, 0)],
    ids=["budgeted", "adaptive", "off"],
)
def test_messages_thinking_and_text_stay_apart(claude, offline, thinking, budget):
    extra = {"thinking": thinking} if thinking else {}
    kw = dict(model="kipp-tiny", max_tokens=12, messages=USER, extra_body=GREEDY, **extra)
    think, text = expected(offline, USER, budget, 12)
    whole = claude.messages.create(**kw)
    got = blocks(whole)
    assert got.get("thinking", "") == think and got.get("text", "") == text
    assert ("thinking" in got) == bool(think)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert whole.id.startswith("msg_") and whole.model == "kipp-tiny"
    with claude.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text
    assert blocks(final) == got and final.stop_reason == "max_tokens"


def test_messages_stream_events_in_anthropic_order(claude, offline):
    kw = dict(model="kipp-tiny", max_tokens=10, messages=USER, extra_body=GREEDY, stream=True)
    events = list(claude.messages.create(thinking={"type": "enabled", "budget_tokens": 2}, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.input_tokens == len(prompt_ids(offline, USER))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert (thinking, events[-2].usage.output_tokens) == (expected(offline, USER, 2, 10)[0], 10)


def test_async_client_create_and_stream(url, offline):
    think, text = expected(offline, USER, BUDGET, 9)

    async def run():
        client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
        kw = dict(model="kipp-tiny", max_tokens=9, messages=USER, extra_body=GREEDY)
        kw["thinking"] = {"type": "adaptive"}
        whole = await client.messages.create(**kw)
        async with client.messages.stream(**kw) as s:
            final = await s.get_final_message()
        await client.close()
        return whole, final

    whole, final = asyncio.run(run())
    assert blocks(whole) == blocks(final) == {"thinking": think, "text": text}


def test_tool_use_round_trip(claude, offline):
    kw = dict(model="kipp-tiny", max_tokens=40, tools=[TOOL], extra_body=GREEDY)
    first = claude.messages.create(
        messages=USER, tool_choice={"type": "tool", "name": "get_weather"}, **kw
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "Oslo") and set(use.input) == {"city"}
    turns = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}],
        },
    ]
    second = claude.messages.create(messages=turns, thinking={"type": "adaptive"}, **kw)
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # the conversation renders as the official template renders its OpenAI equivalent
    call = {"type": "function", "function": {"name": "get_weather", "arguments": use.input}}
    chat = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
    chat.append({"role": "tool", "content": "18C"})
    count = claude.messages.count_tokens(model="kipp-tiny", messages=turns, tools=[TOOL])
    assert count.input_tokens == len(prompt_ids(offline, chat, CHAT_TOOLS))
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == count.input_tokens


def test_streamed_tool_input_concatenates_to_its_json(claude):
    kw = dict(model="kipp-tiny", max_tokens=40, messages=USER, tools=[TOOL], extra_body=GREEDY)
    with claude.messages.stream(tool_choice={"type": "any"}, **kw) as s:
        events = list(s)
        final = s.get_final_message()
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert len(fragments) >= 2 and json.loads("".join(fragments)) == use.input
    assert final.stop_reason == "tool_use"


def test_count_tokens_is_the_official_template(claude, offline):
    system = "Be brief."
    n = claude.messages.count_tokens(model="kipp-tiny", system=system, messages=USER)
    messages = [{"role": "system", "content": system}, *USER]
    assert n.input_tokens == len(prompt_ids(offline, messages))


def test_output_format_holds_the_answer_to_the_schema(claude):
    m = claude.messages.parse(
        model="kipp-tiny", max_tokens=80, messages=USER, output_format=Reading, extra_body=GREEDY
    )
    assert m.stop_reason == "end_turn" and isinstance(m.parsed_output, Reading)


# -- Responses ---------------------------------------------------------------------------------


def items(r) -> dict[str, str]:
    kinds = [i.type for i in r.output]
    assert kinds in (["reasoning", "message"], ["message"]), kinds
    out = {"message": r.output_text}
    for i in r.output:
        if i.type == "reasoning":
            out["reasoning"] = "".join(c.text for c in i.content)
    return out


@pytest.mark.parametrize(
    ("reasoning", "budget"), [(None, BUDGET), ({"effort": "none"}, 0)], ids=["default", "none"]
)
def test_responses_reasoning_and_text_stay_apart(oai, offline, reasoning, budget):
    extra = {"reasoning": reasoning} if reasoning else {}
    kw = dict(model="kipp-tiny", input="Weather in Paris?", max_output_tokens=11, temperature=0)
    think, text = expected(offline, USER, budget, 11)
    r = oai.responses.create(**kw, **extra)
    assert items(r) == ({"reasoning": think, "message": text} if think else {"message": text})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 11 and r.usage.input_tokens == len(prompt_ids(offline, USER))
    assert r.usage.output_tokens_details.reasoning_tokens == budget + 2  # and "\n</think>"
    events = list(oai.responses.create(stream=True, **kw, **extra))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = {"response.reasoning_text.delta": "", "response.output_text.delta": ""}
    for e in events:
        if e.type in deltas:
            deltas[e.type] += e.delta
    assert list(deltas.values()) == [think, text]
    assert items(events[-1].response) == items(r)


def test_function_call_round_trip(oai, offline):
    # greedy: a sampled call may spend its 40 tokens on the grammar's optional whitespace
    kw = dict(model="kipp-tiny", tools=[FUNCTION], max_output_tokens=40, temperature=0)
    first = oai.responses.create(input="Weather in Paris?", tool_choice="required", **kw)
    assert first.status == "completed"
    [call] = [i for i in first.output if i.type == "function_call"]
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Oslo") and call.call_id.startswith("call_")
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},
    ]
    second = oai.responses.create(input=turns, **kw)
    tool_call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": call.arguments},
    }
    chat = [*USER, {"role": "assistant", "content": "", "tool_calls": [tool_call]}]
    chat.append({"role": "tool", "content": "18C"})
    assert second.usage.input_tokens == len(prompt_ids(offline, chat, CHAT_TOOLS))


def test_responses_stream_helper_and_argument_deltas(oai):
    kw = dict(model="kipp-tiny", input="Weather?", tools=[FUNCTION], max_output_tokens=40)
    kw["temperature"] = 0  # as above
    with oai.responses.stream(tool_choice={"type": "function", "name": "get_weather"}, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [call] = [i for i in final.output if i.type == "function_call"]
    assert len(fragments) >= 2 and "".join(fragments) == call.arguments
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert final.status == "completed"


def test_responses_parse_with_a_pydantic_format(oai):
    r = oai.responses.parse(
        model="kipp-tiny", input="A reading, as JSON", max_output_tokens=80, text_format=Reading
    )
    assert isinstance(r.output_parsed, Reading)


def test_chat_completions_streamed_tool_arguments_concatenate(oai):
    stream = oai.chat.completions.create(
        model="kipp-tiny",
        messages=USER,
        tools=CHAT_TOOLS,
        tool_choice="required",
        max_tokens=100,  # room for the budgeted thought and JSON whitespace before the arguments
        temperature=0,  # the same tokens on every run
        stream=True,
    )
    fragments = [
        tc.function.arguments or ""
        for ch in stream
        for c in ch.choices
        for tc in c.delta.tool_calls or []
    ]
    assert json.loads("".join(fragments))["city"] in ("Paris", "Oslo")


def test_chat_completions_thinking_token_budget(oai, offline):
    think, text = expected(offline, USER, 2, 10)
    r = oai.chat.completions.create(
        model="kipp-tiny",
        messages=USER,
        max_tokens=10,
        temperature=0,
        extra_body={"thinking_token_budget": 2},
    )
    msg = r.choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (think, text)


# -- errors ------------------------------------------------------------------------------------


def test_bad_requests_get_each_apis_error(claude, oai, url):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="kipp-tiny", max_tokens=5, messages=[])
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="kipp-tiny", max_tokens=5, messages=USER
        )
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="kipp-tiny", input="x", previous_response_id="resp_1")
    assert "keeps no responses" in e.value.body["message"]
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="kipp-tiny", input="x", store=True)
    assert e.value.body["param"] == "store"
