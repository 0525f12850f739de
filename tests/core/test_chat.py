"""kipp_core.chat.render against two outside references: transformers' apply_chat_template with
the official Qwen3 template (through the kipp-tiny tokenizer), and the raw template rendered by
jinja2 in the environment transformers uses. Also the rendered examples quoted in QWEN3.md."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kipp_core.chat import render
from kipp_core.vocab import chat_template

TEMPLATE_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"  # QWEN3.md §4


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # what transformers' _compile_jinja_template sets up (QWEN3.md §4)
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env


JINJA = _jinja_env().from_string(chat_template())


def jinja_render(messages, tools=None, add_generation_prompt=True, enable_thinking=True):
    return JINJA.render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


@pytest.fixture(scope="module")
def hf_tok(tiny_path):  # tiny_path: the session fixture in tests/conftest.py
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_path))
    assert tok.chat_template == chat_template()
    return tok


def check(tok, messages, tools=None, gen=True, think=True) -> str:
    got = render(messages, tools, add_generation_prompt=gen, enable_thinking=think)
    assert got == jinja_render(messages, tools, gen, think)
    ref = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen, enable_thinking=think
    )
    assert got == ref
    return got


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


# --- property-based: random conversations ------------------------------------------------------

FRAGMENTS = [
    "\n",
    "\n\n",
    " ",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
    "<|im_end|>",
    "<tool_call>",
    '"',
    "é",
    "😀",
]
text = st.lists(st.one_of(st.text(max_size=6), st.sampled_from(FRAGMENTS)), max_size=6).map("".join)
think_text = st.builds(lambda a, b, c: a + "<think>" + b + "</think>" + c, text, text, text)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=8,
)
# Choices are drawn with sampled_from over lists with repeats, which weights them, and the keys
# are set explicitly (fixed_dictionaries leaves optional keys out most of the time): measured
# over 150 examples, most conversations reach the think, tool-call and merged-tool branches.
CONTENT = {
    "text": text,
    "think": think_text,
    "none": st.none(),
    "int": st.integers(),
    "tool_response": text.map(lambda t: "<tool_response>" + t + "</tool_response>"),
    "tr_prefix": text.map(lambda t: "<tool_response>" + t),
    "newlines": st.sampled_from(["\n"] * 3),
    "blocks": st.just([{"type": "text", "text": "block"}]),
}
CONTENT_KINDS = [
    "text",
    "text",
    "text",
    "think",
    "think",
    "tool_response",
    "tr_prefix",
    "newlines",
    "none",
    "int",
    "blocks",
    "missing",
]
ROLES = ["user"] * 3 + ["assistant"] * 4 + ["tool"] * 2 + ["system", "developer"]


def _pick(draw, kinds, strategies):
    kind = draw(st.sampled_from(kinds))
    return kind, (None if kind == "missing" else draw(strategies[kind]))


@st.composite
def tool_call(draw):
    _, args = _pick(
        draw,
        ["dict", "dict", "json", "string"],
        {"dict": st.dictionaries(text, json_value, max_size=3), "json": json_value, "string": text},
    )
    call = {"arguments": args}
    kind, name = _pick(
        draw,
        ["text", "text", "text", "int", "none", "missing"],
        {"text": text, "int": st.integers(), "none": st.none()},
    )
    if kind != "missing":
        call["name"] = name
    wrap = draw(st.sampled_from(["bare", "wrapped", "falsy_wrapper"]))
    if wrap == "falsy_wrapper":  # a falsy "function" is not unwrapped
        return {"function": draw(st.sampled_from([{}, None, ""])), **call}
    return {"type": "function", "function": call} if wrap == "wrapped" else call


@st.composite
def message(draw, roles=ROLES):
    m = {"role": draw(st.sampled_from(roles))}
    kind, value = _pick(draw, CONTENT_KINDS, CONTENT)
    if kind != "missing":
        m["content"] = value
    if m["role"] == "assistant":
        kind, value = _pick(
            draw,
            ["missing", "missing", "text", "empty", "none"],
            {"text": text, "empty": st.just(""), "none": st.none()},
        )
        if kind != "missing":
            m["reasoning_content"] = value
        kind, value = _pick(
            draw,
            ["missing", "missing", "calls", "none", "empty"],
            {
                "calls": st.lists(tool_call(), min_size=1, max_size=3),
                "none": st.none(),
                "empty": st.just([]),
            },
        )
        if kind != "missing":
            m["tool_calls"] = value
    return m


tool_schema = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": text}, optional={"description": text, "parameters": json_value}
        ),
    }
)


def tool_lists(n):  # None (no tools) or n tools, [] included
    return st.none() if n is None else st.lists(tool_schema, min_size=n, max_size=n + 1)


@st.composite
def conversations(draw):
    # turns that mostly open with a real query, then random messages of any role
    msgs = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 3)):
            msgs.append({"role": "user", "content": draw(text)})
        msgs.extend(draw(st.lists(message(), max_size=4)))
        msgs.extend(draw(st.lists(message(roles=["tool"]), max_size=3)))  # merged tool results
        msgs.extend(draw(st.lists(message(roles=["assistant"]), max_size=2)))
    msgs = msgs or [draw(message())]
    if msgs[0]["role"] == "system" and not isinstance(msgs[0].get("content"), str):
        msgs[0]["content"] = draw(text)  # the template only renders a string system prompt
    return msgs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=conversations(),
    tools=st.sampled_from([None, 0, 1, 2]).flatmap(tool_lists),
    gen=st.booleans(),
    think=st.booleans(),
)
def test_random_conversations_match_references(hf_tok, messages, tools, gen, think):
    check(hf_tok, messages, tools, gen, think)
