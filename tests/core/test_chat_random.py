"""kipp_core.chat.render against the official templates' two renderers (chat_references.py),
Qwen3's and both 2507 ones, on random conversations: any role order, content as strings, parts
lists or None, tool calls with dict or string arguments, and text fragments that collide with the
template's own markup."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.chat_references import check

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


# 300 examples over the three templates: ~100 each, as the Qwen3 template alone had before
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=conversations(),
    tools=st.sampled_from([None, 0, 1, 2]).flatmap(tool_lists),
    gen=st.booleans(),
    think=st.booleans(),
    template=st.sampled_from(["qwen3", "qwen3-instruct-2507", "qwen3-thinking-2507"]),
)
def test_random_conversations_match_references(hf_toks, messages, tools, gen, think, template):
    check(hf_toks[template], messages, tools, gen, think, template)
