"""kipp_core.chat.render against the official template's two renderers (chat_references.py) on
hand-written cases, the rendered examples quoted in QWEN3.md, and invalid input."""

from __future__ import annotations

import hashlib
import json

import pytest

from kipp_core.chat import render
from kipp_core.vocab import chat_template
from tests.core.chat_references import check, jinja_render

TEMPLATE_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"  # QWEN3.md §4


def test_template_is_the_official_one():
    assert hashlib.sha256(chat_template().encode()).hexdigest() == TEMPLATE_SHA256


# --- hand-written cases -------------------------------------------------------------------------


def U(c):
    return {"role": "user", "content": c}


def A(c=None, **kw):
    m = {"role": "assistant", **kw}
    if c is not None:
        m["content"] = c
    return m


def S(c):
    return {"role": "system", "content": c}


def T(c):
    return {"role": "tool", "content": c}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo — 天气",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALC = {"type": "function", "function": {"name": "calc", "parameters": {"x": [1, 2.5, None]}}}
TR = "<tool_response>\n42\n</tool_response>"
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}

CASES = {
    "user": ([U("Hi")], None),
    "system_user": ([S("Be brief."), U("Hi")], None),
    "system_user_assistant": ([S("sys"), U("Hi"), A("Hello")], None),
    "system_not_first": ([U("a"), S("late"), U("b")], None),
    "two_systems": ([S("one"), S("two"), U("q")], None),
    "system_only": ([S("just a system prompt")], None),
    "empty_system": ([S(""), U("q")], None),
    "tools_no_system": ([U("weather?")], [WEATHER]),
    "tools_with_system": ([S("sys\n"), U("weather?")], [WEATHER, CALC]),
    "tools_empty_list": ([S("sys"), U("q")], []),
    "tools_system_not_first": ([U("q"), S("late")], [CALC]),
    "multi_turn_think": (
        [U("Q1"), A("<think>\nr1\n</think>\n\nA1"), U("Q2"), A("<think>\nr2\n</think>\n\nA2")],
        None,
    ),
    "think_no_open_tag": ([U("q"), A("\n\nonly reasoning\n</think>\n\nanswer")], None),
    "think_twice": ([U("q"), A("<think>a</think>b<think>c</think>\n\nd")], None),
    "think_text_before_open": ([U("q"), A("pre\n<think>\nr\n</think>\n\nans")], None),
    "think_two_opens": ([U("q"), A("<think>a<think>\nb</think>c")], None),
    "think_open_only": ([U("q"), A("<think>never closed")], None),
    "think_whitespace": ([U("q"), A("<think>\n\n  r \n\n</think>\n\n\n  ans\n")], None),
    "reasoning_content_last": ([U("q"), A("ans", reasoning_content="\nwhy\n\n")], None),
    "reasoning_content_history": ([U("q1"), A("a1", reasoning_content="r1"), U("q2")], None),
    # a string reasoning_content (even '') stops the content from being split
    "reasoning_content_blocks_split": (
        [U("q"), A("<think>x</think>y", reasoning_content="")],
        None,
    ),
    "reasoning_content_none": ([U("q"), A("<think>x</think>y", reasoning_content=None)], None),
    "reasoning_content_list": ([U("q"), A("<think>x</think>y", reasoning_content=["r"])], None),
    "last_assistant_no_reasoning": ([U("q"), A("plain")], None),
    "assistant_after_query_not_last": ([U("q"), A("a"), A("b", reasoning_content="r")], None),
    "assistant_first": ([A("<think>r</think>hello"), U("q")], None),
    "only_assistants": ([A("<think>r</think>x"), A("y")], None),
    "multi_step_tools": (
        [
            S("sys"),
            U("Weather in Zürich and Paris?"),
            A("", reasoning_content="need two calls", tool_calls=[CALL, CALL]),
            T("18°C"),
            T('{"temp": 21}'),
            A(
                "<think>\ncompare\n</think>\n\nLet me check",
                tool_calls=[{"name": "calc", "arguments": '{"x": 1}'}],
            ),
            T("1"),
            A("<think>done</think>Zürich 18°C, Paris 21°C."),
        ],
        [WEATHER, CALC],
    ),
    "tool_response_user_not_a_query": (
        [U("q"), A("<think>r1</think>c1"), U(TR), A("<think>r2</think>c2")],
        None,
    ),
    "tool_response_prefix_only_is_a_query": (
        [U("q"), A("<think>r1</think>c1"), U("<tool_response> no end"), A("<think>r2</think>c2")],
        None,
    ),
    "no_real_query": ([U(TR), A("<think>r</think>c"), U(TR), A("<think>r</think>d")], None),
    "query_nonstring_content": (
        [U("q"), A("<think>r</think>a"), U(None), A("<think>r2</think>b")],
        None,
    ),
    "tool_calls_no_wrapper_dict_args": (
        [
            U("q"),
            A(
                tool_calls=[
                    {
                        "name": "f",
                        "arguments": {"a": [1, {"b": "ü"}], "n": None, "t": True, "f": 1.5},
                    }
                ]
            ),
        ],
        None,
    ),
    "tool_calls_string_args": (
        [
            U("q"),
            A("text", tool_calls=[{"function": {"name": "f", "arguments": "{not json at all"}}]),
        ],
        None,
    ),
    "tool_calls_args_types": (
        [
            U("q"),
            A(
                tool_calls=[
                    {"name": "f", "arguments": None},
                    {"name": "g", "arguments": [1, "二"]},
                    {"name": "h", "arguments": 3},
                    {"name": "i", "arguments": ""},
                ]
            ),
        ],
        None,
    ),
    "tool_call_name_types": (
        [
            U("q"),
            A(
                "c",
                tool_calls=[
                    {"name": 7, "arguments": {}},
                    {"name": None, "arguments": {}},
                    {"name": {"x": [1]}, "arguments": {}},
                    {"arguments": {}},
                    {"name": 'q"', "arguments": {}},
                    {"function": {"name": 1.5, "arguments": {}}},
                ],
            ),
        ],
        None,
    ),
    "tool_call_empty_function_not_unwrapped": (
        [U("q"), A(tool_calls=[{"function": {}, "name": "outer", "arguments": {"k": "v"}}])],
        None,
    ),
    "tool_calls_empty": ([U("q"), A("c", tool_calls=[]), U("r")], None),
    "tool_calls_none": ([U("q"), A("c", tool_calls=None)], None),
    "tool_calls_history": ([U("q"), A("c", tool_calls=[CALL]), T("x"), A("done"), U("next")], None),
    # content '\n' counts for the newline before the first call although the lstrip removed it
    "tool_calls_newline_quirk": ([U("q"), A("\n", reasoning_content="r", tool_calls=[CALL])], None),
    "tool_calls_think_only_content": ([U("q"), A("<think>r</think>\n\n", tool_calls=[CALL])], None),
    "tools_merged": ([U("q"), T("a"), T("b"), T("c"), U("next"), T("d")], None),
    "tool_first": ([T("x"), U("q")], None),
    "tool_unknown_between": ([U("q"), T("a"), {"role": "developer", "content": "z"}, T("b")], None),
    "tool_nonstring_content": ([U("q"), T(None), T(["x"]), {"role": "tool"}], None),
    "nonstring_content": (
        [
            U(None),
            U(["a", "b"]),
            U(5),
            {"role": "user"},
            A(None),
            A(["x"]),
            S({"k": 1}),
            {"role": "system"},
        ],
        None,
    ),
    "content_blocks": (
        [U([{"type": "text", "text": "hi"}]), A([{"type": "text", "text": "x"}])],
        None,
    ),
    "unknown_roles": (
        [
            U("q"),
            {"role": "developer", "content": "d"},
            {"role": "", "content": "e"},
            {"role": "function", "content": "f"},
        ],
        None,
    ),
    "unicode_and_specials": ([S("系统\n\n"), U("😀 <|im_end|> \r\n\t"), A("\x00\u2028end")], None),
    "extra_keys_ignored": ([{"role": "user", "content": "q", "name": "bob", "id": 3}], None),
}


@pytest.mark.parametrize("gen,think", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("name", list(CASES))
def test_cases_match_references(hf_tok, name, gen, think):
    messages, tools = CASES[name]
    check(hf_tok, messages, tools, gen, think)


@pytest.mark.parametrize("value", [0, None, "false", 1])
def test_enable_thinking_is_an_identity_test(hf_tok, value):
    # `enable_thinking is false` in jinja is `value is False`: falsy non-bools do not count
    out = check(hf_tok, [U("q")], think=value)
    assert out.endswith("<|im_start|>assistant\n")


def test_jinja_only_cases():
    # transformers refuses tools that are not dicts or functions; the raw template dumps anything
    tools = ["a string tool", 5, None, [1, {"é": 2}]]
    assert render([U("q")], tools) == jinja_render([U("q")], tools)
    # transformers (>= 5) copies "thinking" / "reasoning" keys into reasoning_content before
    # rendering; the official template reads only reasoning_content, and render follows it
    msgs = [U("q"), A("<think>r</think>c", thinking="t"), A("x", reasoning="z")]
    assert render(msgs) == jinja_render(msgs)


def test_defaults_and_input_untouched():
    msgs = [U("q"), A("<think>r</think>c", tool_calls=[CALL])]
    before = json.dumps(msgs)
    assert render(msgs) == render(msgs, None, True, True) == jinja_render(msgs)
    assert json.dumps(msgs) == before


# --- QWEN3.md §4 rendered examples (literal strings) --------------------------------------------


def test_qwen3_md_examples():
    hi = [U("Hi")]
    assert render(hi) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(hi, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render([U("Hi"), A("Hello")], add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "Hello<|im_end|>\n"
    )
    msgs = [U("Q1"), A("<think>\nr1\n</think>\n\nA1"), U("Q2"), A("<think>\nr2\n</think>\n\nA2")]
    assert render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\n"
        "Q2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n"
    )


def test_tools_system_turn_layout():
    out = render([S("sys"), U("q")], [CALC], add_generation_prompt=False)
    assert out == (
        "<|im_start|>system\nsys\n\n# Tools\n\nYou may call one or more functions to assist with "
        "the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
        'tags:\n<tools>\n{"type": "function", "function": {"name": "calc", "parameters": '
        '{"x": [1, 2.5, null]}}}\n</tools>\n\nFor each function call, return a json object with '
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nq<|im_end|>\n"
    )


# --- invalid input ------------------------------------------------------------------------------

# input the template itself cannot render: render raises ValueError, jinja raises too
TEMPLATE_FAILS = {
    "empty": ([], None, "non-empty list"),
    "system_content_none": ([S(None), U("q")], None, "system"),
    "system_content_list": ([S(["x"]), U("q")], [CALC], "system"),
    "system_content_missing": ([{"role": "system"}, U("q")], None, "system"),
    "call_without_arguments": ([U("q"), A(tool_calls=[{"name": "f"}])], None, "arguments"),
    "call_function_is_a_string": (
        [U("q"), A(tool_calls=[{"function": "f", "arguments": {}}])],
        None,
        "arguments",
    ),
    "call_not_a_dict": ([U("q"), A(tool_calls=["f"])], None, r"tool_calls\[0\]"),
    "tool_calls_a_dict": (
        [U("q"), A(tool_calls={"name": "f", "arguments": {}})],
        None,
        "tool_calls must be a list",
    ),
    "tool_calls_a_string": ([U("q"), A(tool_calls="f")], None, "tool_calls must be a list"),
    "arguments_not_json": (
        [U("q"), A(tool_calls=[{"name": "f", "arguments": {1, 2}}])],
        None,
        "JSON",
    ),
    "tool_not_json": ([U("q")], [{"x": object()}], r"tools\[0\]"),
}


@pytest.mark.parametrize("name", list(TEMPLATE_FAILS))
def test_template_failures_raise_value_error(name):
    messages, tools, match = TEMPLATE_FAILS[name]
    with pytest.raises(ValueError, match=match):
        render(messages, tools)
    with pytest.raises(Exception):  # noqa: B017 - jinja raises TypeError / UndefinedError
        jinja_render(messages, tools)


@pytest.mark.parametrize(
    "messages,tools,match",
    [
        ({"role": "user", "content": "q"}, None, "list"),
        ("hello", None, "list"),
        ((U("q"),), None, "list"),
        ([U("q"), "not a dict"], None, r"messages\[1\]"),
        ([U("q"), {"content": "no role"}], None, r"messages\[1\].*role"),
        ([{"role": None, "content": "q"}], None, r"messages\[0\].*role"),
        ([{"role": 3, "content": "q"}], None, "role"),
        ([U("q")], "tools", "tools must be a list"),
        ([U("q")], {"name": "f"}, "tools must be a list"),
    ],
)
def test_invalid_input(messages, tools, match):
    with pytest.raises(ValueError, match=match):
        render(messages, tools)
