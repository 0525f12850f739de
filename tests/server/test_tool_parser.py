"""parse_tool_calls on known outputs, and ToolCallStream against parse_tool_calls for any split."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kipp_core.server.reasoning import ReasoningStream, split_reasoning
from kipp_core.server.tool_parser import (
    CLOSE,
    OPEN,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
)

FAST = settings(max_examples=200, deadline=None)


def block(payload: object, before: str = "\n", after: str = "\n") -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return OPEN + before + text + after + CLOSE


WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER_CALL = ToolCall("get_weather", '{"city": "Paris"}')


# ---- whole outputs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (block(WEATHER), None, [WEATHER_CALL]),
        ("\n\n" + block(WEATHER) + "\n", None, [WEATHER_CALL]),
        ("I'll check.\n\n" + block(WEATHER), "I'll check.", [WEATHER_CALL]),
        (
            block(WEATHER) + "\n" + block({"name": "f", "arguments": {}}),
            None,
            [WEATHER_CALL, ToolCall("f", "{}")],
        ),
        (block(WEATHER) + "\n\nDone. ", "Done.", [WEATHER_CALL]),
        ("A " + block(WEATHER) + " B", "A  B", [WEATHER_CALL]),  # inner whitespace is kept
        # Leading whitespace of text before the first call has been streamed already: kept.
        ("  Hi " + block(WEATHER), "  Hi", [WEATHER_CALL]),
        ("plain text\n", "plain text\n", []),  # no calls: unchanged
        ("", "", []),
        ("  ", "  ", []),
        ("x " + block("not json") + " y", "x " + block("not json") + " y", []),
        (block("not json") + block(WEATHER), block("not json"), [WEATHER_CALL]),
        (block(WEATHER) + " " + block("[1]") + "\n", block("[1]"), [WEATHER_CALL]),
        (OPEN + '\n{"name": "f", "arguments": {}', OPEN + '\n{"name": "f", "arguments": {}', []),
        (block(WEATHER) + OPEN + "{", OPEN + "{", [WEATHER_CALL]),  # unterminated second block
        # A block ends at the first close tag, even one inside a JSON string.
        (
            block({"name": "f", "arguments": {"t": CLOSE}}),
            block({"name": "f", "arguments": {"t": CLOSE}}),
            [],
        ),
        # An open tag inside a block is just text of that block.
        (OPEN + "x" + block(WEATHER), OPEN + "x" + block(WEATHER), []),
        ("</tool_call> stray", "</tool_call> stray", []),
    ],
)
def test_parse_tool_calls(text, content, calls) -> None:
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize(
    ("payload", "arguments"),
    [
        ({"name": "f", "arguments": {"city": "Zürich"}}, '{"city": "Zürich"}'),  # no \u escapes
        ({"name": "f", "parameters": {"a": 1}}, '{"a": 1}'),
        ({"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}, '{"a": 1}'),
        ({"name": "f", "arguments": '{"a":1}'}, '{"a":1}'),  # a JSON-object string, kept verbatim
        ('{"name":"f","arguments":{"x":[1,2.5,null,true]}}', '{"x": [1, 2.5, null, true]}'),
        (
            '{"name": "f", "arguments": {"big": 12345678901234567890}}',
            '{"big": 12345678901234567890}',
        ),
    ],
)
def test_arguments_text(payload, arguments) -> None:
    content, calls = parse_tool_calls(block(payload))
    assert content is None and calls == [ToolCall("f", arguments)]
    assert isinstance(json.loads(calls[0].arguments), dict)


@pytest.mark.parametrize(
    "payload",
    [
        "not json",
        "",
        "[1, 2]",
        '"f"',
        '{"name": "f"}',
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "Paris"}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f", "arguments": null}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": {"x": 1e999}}',
        '{"name": "f", "arguments": {}} extra',
        '{"name": "f", "arguments": {}}{}',
        "{'name': 'f', 'arguments': {}}",
        '\u00a0{"name": "f", "arguments": {}}',
    ],
)
def test_invalid_blocks_stay_text(payload: str) -> None:
    text = "Hi " + block(payload)
    assert parse_tool_calls(text) == (text, [])
    assert run_stream([text]) == (text, [])


def test_lone_surrogates_are_escaped_or_rejected() -> None:
    _, calls = parse_tool_calls(block('{"name": "f", "arguments": {"a": "\\ud800"}}'))
    assert calls == [ToolCall("f", '{"a": "\\ud800"}')]  # escaped: UTF-8 cannot carry it raw
    _, calls = parse_tool_calls(block('{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}'))
    assert calls == [ToolCall("f", '{"a": "\\ud800"}')]
    text = block('{"name": "\\ud800", "arguments": {}}')
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls(block('{"name": "f", "arguments": {"a": "\\ud83d\\ude00"}}'))[1] == [
        ToolCall("f", '{"a": "\U0001f600"}')
    ]  # a proper pair is one character


def test_new_call_id() -> None:
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


# ---- streaming ------------------------------------------------------------------------------


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def run_stream(pieces: list[str]):
    stream = ToolCallStream(id_factory=counter_ids())
    return collect([d for piece in pieces for d in stream.feed(piece)] + stream.finish())


def collect(deltas: list) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from deltas, checking the OpenAI delta shape on the way."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, str):
            assert d, "empty content deltas are dropped"
            content += d
        elif d.id is not None:  # the first delta of a call
            assert d.index == len(calls) and d.name and d.arguments == ""
            calls.append([d.name, ""])
        else:
            assert d.index == len(calls) - 1 and d.name is None
            calls[-1][1] += d.arguments
    return content, [tuple(c) for c in calls]


def whole(text: str):
    content, calls = parse_tool_calls(text)
    return content or "", [(c.name, c.arguments) for c in calls]


_names = st.text(alphabet="abcxyz_", min_size=1, max_size=6)
_scalars = st.none() | st.booleans() | st.integers(-999, 999) | st.text(max_size=5)
_args = st.dictionaries(st.text(max_size=4), _scalars | st.lists(_scalars, max_size=3), max_size=3)
_ws = st.text(alphabet=" \n\t", max_size=3)
_TEXT_PIECES = ["Hi", " ", "\n", "<", "</", ">", "tool_call", "<tool_", "</tool_call>", "{", "x"]


@st.composite
def valid_blocks(draw) -> tuple[str, ToolCall]:
    name, args = draw(_names), draw(_args)
    key = draw(st.sampled_from(["arguments", "parameters"]))
    as_string = draw(st.booleans())
    payload = {"name": name, key: json.dumps(args) if as_string else args}
    seps = draw(st.sampled_from([None, (",", ":")]))
    text = OPEN + draw(_ws) + json.dumps(payload, separators=seps) + draw(_ws) + CLOSE
    arguments = json.dumps(args) if as_string else json.dumps(args, ensure_ascii=False)
    return text, ToolCall(name, arguments)


@st.composite
def invalid_blocks(draw) -> str:
    junk = draw(
        st.sampled_from(
            [
                "oops",
                '{"name": "f"}',
                '{"name": "f", "arguments": 1}',
                '{"arguments": {}}',
                "[1]",
                '{"name": "f", "arguments": {}} x',
                '{"name": "f", "arguments": {"a": tru}}',
                "{",
                '{"name": "f", <tool_call>',
                "",
            ]
        )
    )
    return OPEN + draw(_ws) + junk + draw(_ws) + CLOSE


@st.composite
def outputs(draw) -> tuple[str, list[ToolCall] | None]:
    """A model output mixing text, valid and invalid blocks; the calls it holds if known."""
    parts, calls, known = [], [], True
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["text", "soup", "valid", "invalid"]))
        if kind == "text":
            parts.append(draw(st.text(alphabet="ab \n.", max_size=6)))
        elif kind == "soup":  # tag fragments: may form tags by accident
            parts.append("".join(draw(st.lists(st.sampled_from(_TEXT_PIECES), max_size=5))))
            known = False
        elif kind == "valid":
            text, call = draw(valid_blocks())
            parts.append(text)
            calls.append(call)
        else:
            parts.append(draw(invalid_blocks()))
    if draw(st.booleans()):  # cut off mid-block by max_tokens
        text, _ = draw(valid_blocks())
        parts.append(text[: draw(st.integers(0, len(text) - 1))])
    return "".join(parts), (calls if known else None)


def _splits(data, text: str) -> list[str]:
    """Any split of `text` into deltas: one char each, all at once, or random cuts."""
    how = data.draw(st.sampled_from(["chars", "whole", "cuts", "cuts"]))
    if how != "cuts":
        return list(text) if how == "chars" else [text]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@FAST
@given(outputs())
def test_whole_finds_the_calls_written(output) -> None:
    text, calls = output
    if calls is not None:
        assert parse_tool_calls(text)[1] == calls


@FAST
@given(st.data())
def test_stream_equals_whole(data) -> None:
    text, _ = data.draw(outputs())
    assert run_stream(_splits(data, text)) == whole(text)


@FAST
@given(st.text(alphabet='<>/tool_cal {}"\n:a', max_size=40), st.data())
def test_stream_equals_whole_random_text(text: str, data) -> None:
    assert run_stream(_splits(data, text)) == whole(text)


@FAST
@given(st.data())
def test_reasoning_then_tools_stream_equals_whole(data) -> None:
    """The server chain: reasoning split first, then tool calls in the content."""
    body, _ = data.draw(outputs())
    text = data.draw(st.sampled_from(["", "<think>\n", "<think>\nhm\n</think>\n\n"])) + body
    reasoning_stream, tool_stream = ReasoningStream(), ToolCallStream(id_factory=counter_ids())
    reasoning, deltas = "", []
    for chunk in [*_splits(data, text), None]:
        r, c = reasoning_stream.feed(chunk) if chunk is not None else reasoning_stream.finish()
        reasoning += r
        deltas += tool_stream.feed(c)
    deltas += tool_stream.finish()
    want_reasoning, want_content = split_reasoning(text)
    assert reasoning == (want_reasoning or "")
    assert collect(deltas) == whole(want_content)


def test_stream_is_live_and_shaped_like_openai() -> None:
    s = ToolCallStream(id_factory=counter_ids())
    assert s.feed("Let me check") == ["Let me check"]
    assert s.feed(" the weather.\n\n<tool") == [" the weather."]  # whitespace + tag held
    assert s.feed('_call>\n{"name": "get_weather", ') == []
    assert s.feed('"arguments": {"city": "Paris"}}\n</tool_call>') == [
        ToolCallDelta(0, "call_0", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city":'),
        ToolCallDelta(0, None, None, ' "Paris"}'),
    ]
    assert s.feed("\n") == []
    assert s.feed(block({"name": "f", "arguments": {}})) == [
        ToolCallDelta(1, "call_1", "f", ""),
        ToolCallDelta(1, None, None, "{"),
        ToolCallDelta(1, None, None, "}"),
    ]
    assert s.feed("\n") == []
    assert s.finish() == []  # trailing whitespace after calls is dropped


def test_stream_releases_bad_block_early() -> None:
    s = ToolCallStream()
    assert s.feed("<tool_call>\n") == []
    assert s.feed("not json") == ["<tool_call>\nnot json"]  # "n" cannot start a JSON object
    assert s.feed(" <tool_call>") == [" <tool_call>"]  # still inside the bad block: text
    assert s.feed("</tool_call>") == ["</tool_call>"]
    assert s.finish() == []


def test_stream_releases_complete_object_without_name_early() -> None:
    s = ToolCallStream()
    assert s.feed('<tool_call>{"arguments": {}') == []
    assert s.feed("}") == ['<tool_call>{"arguments": {}}']


def test_stream_whitespace_rules() -> None:
    assert run_stream([" \n", "Hi", " \n"]) == (" \nHi \n", [])  # no calls: unchanged
    s = ToolCallStream(id_factory=counter_ids())
    assert s.feed(block(WEATHER)) == [
        ToolCallDelta(0, "call_0", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city":'),
        ToolCallDelta(0, None, None, ' "Paris"}'),
    ]
    assert s.feed("\n\n  Done") == ["Done"]  # leading whitespace after a call is dropped
    assert s.feed("  ") == []
    assert s.feed("!") == ["  !"]
    assert s.finish() == []


def test_stream_unterminated_block_is_text_at_finish() -> None:
    s = ToolCallStream()
    assert s.feed('<tool_call>\n{"name": "f", "argu') == []
    assert s.finish() == ['<tool_call>\n{"name": "f", "argu']
