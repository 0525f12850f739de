"""split_reasoning against the chat template's rules; ReasoningStream against split_reasoning."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kipp_core.server.reasoning import ReasoningStream, partial_tag_len, split_reasoning

FAST = settings(max_examples=200, deadline=None)


@pytest.mark.parametrize(
    ("text", "enabled", "expected"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", True, ("Let me see.", "Paris.")),
        ("<think>\n\n</think>\n\nHi", True, ("", "Hi")),  # an empty block: "" not None
        ("<think></think>Hi", True, ("", "Hi")),
        ("Hi there", True, (None, "Hi there")),
        ("\n Hi\n", True, (None, "\n Hi\n")),  # no block: content is the text unchanged
        ("", True, (None, "")),
        ("<think>\nr\n</think>\n\nc", False, (None, "<think>\nr\n</think>\n\nc")),
        ("<think>\nstill thinking\n\n", True, ("still thinking", "")),  # cut by max_tokens
        ("<think>", True, ("", "")),
        ("<think>\nr</thi", True, ("r</thi", "")),
        ("\n  <think>\nr\n</think>\nc", True, ("r", "c")),  # whitespace before <think>
        ("<think>\na\n\nb\n</think>\n\n c\n\n", True, ("a\n\nb", " c\n\n")),
        ("<think>r</think>c</think>d", True, ("r", "c</think>d")),  # the first close ends it
        ("<think>x<think>y</think>z", True, ("x<think>y", "z")),
        ("<thinking>x</thinking>", True, (None, "<thinking>x</thinking>")),
        ("<thin", True, (None, "<thin")),
        ("x<think>r</think>", True, (None, "x<think>r</think>")),
        ("<think>\n\n\n</think>\n\n\n", True, ("", "")),
    ],
)
def test_split_reasoning(text, enabled, expected) -> None:
    assert split_reasoning(text, enabled) == expected
    assert run_stream(text.split("\n"), enabled, keep_separators=True) == as_strings(expected)


# A reasoning/content pair renders as the template does it; parsing gives the pair back.
_free_text = st.text(alphabet="ab <>/\n\t", max_size=12).filter(lambda s: "</think>" not in s)


@FAST
@given(_free_text.map(lambda s: s.strip("\n")), _free_text.map(lambda s: s.lstrip("\n")))
def test_template_round_trip(reasoning: str, content: str) -> None:
    rendered = "<think>\n" + reasoning + "\n</think>\n\n" + content
    assert split_reasoning(rendered) == (reasoning, content)


def as_strings(pair: tuple[str | None, str]) -> tuple[str, str]:
    return pair[0] or "", pair[1]


def run_stream(pieces: list[str], enabled=True, keep_separators=False, opened=False):
    if keep_separators:  # pieces came from text.split("\n"): put the newlines back
        pieces = [p + "\n" for p in pieces[:-1]] + pieces[-1:]
    stream = ReasoningStream(enabled, opened)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


_PIECES = ["<think>", "</think>", "<", "</", "think", ">", "\n", "\n\n", " ", "a", "b", "<th", "k>"]


@st.composite
def outputs(draw) -> str:
    """Text made of tag fragments, newlines and letters, often shaped like a real think block."""
    soup = "".join(draw(st.lists(st.sampled_from(_PIECES), max_size=12)))
    if draw(st.booleans()):
        return soup
    head = draw(st.sampled_from(["", "\n", " \n"])) + "<think>" + draw(st.sampled_from(["", "\n"]))
    return head + soup + "".join(draw(st.lists(st.sampled_from(_PIECES), max_size=6)))


def _splits(data, text: str) -> list[str]:
    """Any split of `text` into deltas: one char each, all at once, or random cuts."""
    how = data.draw(st.sampled_from(["chars", "whole", "cuts", "cuts"]))
    if how != "cuts":
        return list(text) if how == "chars" else [text]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@FAST
@given(st.data())
def test_stream_equals_whole(data) -> None:
    text = data.draw(outputs())
    enabled = data.draw(st.booleans())
    assert run_stream(_splits(data, text), enabled) == as_strings(split_reasoning(text, enabled))


@FAST
@given(st.text(max_size=30), st.data())
def test_stream_equals_whole_any_text(text: str, data) -> None:
    assert run_stream(_splits(data, text)) == as_strings(split_reasoning(text))


def test_stream_is_live() -> None:
    s = ReasoningStream()
    assert s.feed("\n") == ("", "")  # could still become "<think>"
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>\n") == ("", "")  # leading newline of reasoning: stripped
    assert s.in_reasoning
    assert s.feed("Let me") == ("Let me", "")
    assert s.feed(" see\n") == (" see", "")  # the newline may end the reasoning
    assert s.feed("\nok") == ("\n\nok", "")  # it did not
    assert s.feed("\n</th") == ("", "")
    assert s.feed("ink>") == ("", "")
    assert not s.in_reasoning
    assert s.feed("\n\n") == ("", "")  # content's leading newlines: stripped
    assert s.feed("Hi") == ("", "Hi")
    assert s.feed("\n") == ("", "\n")  # content keeps trailing newlines: sent at once
    assert s.finish() == ("", "")


def test_stream_without_think_block_passes_through() -> None:
    s = ReasoningStream()
    assert s.feed("Hello") == ("", "Hello")
    assert s.feed(" <think>") == ("", " <think>")
    off = ReasoningStream(enabled=False)
    assert off.feed("<think>") == ("", "<think>")


def test_stream_holds_partial_close_and_releases_it() -> None:
    s = ReasoningStream()
    assert s.feed("<think>a</thi") == ("a", "")
    assert s.feed("s") == ("</this", "")
    assert s.finish() == ("", "")


def test_stream_cut_off_in_reasoning() -> None:
    s = ReasoningStream()
    assert s.feed("<think>\nhalf a thought\n\n") == ("half a thought", "")
    assert s.finish() == ("", "")


def test_stream_whitespace_only_output() -> None:
    s = ReasoningStream()
    assert s.feed(" \n") == ("", "")
    assert s.finish() == ("", " \n")


def test_partial_tag_len() -> None:
    assert partial_tag_len("abc</th", "</think>") == 4
    assert partial_tag_len("abc<", "</think>") == 1
    assert partial_tag_len("abc</think>", "</think>") == 0  # whole tags are not partial
    assert partial_tag_len("", "</think>") == 0
    assert partial_tag_len("<<", "<tool_call>") == 1


# -- a prompt that opened the block (Qwen3-4B-Thinking-2507) ------------------------------------


def deepseek_r1(text: str) -> tuple[str, str | None]:
    """vLLM's DeepSeekR1ReasoningParser.extract_reasoning_content, the parser the Thinking-2507
    model card serves with (hand-copied): an optional <think>, then reasoning to </think>."""
    head, tag, tail = text.partition("<think>")
    text = tail if tag else head
    if "</think>" not in text:
        return text, None
    reasoning, _, content = text.partition("</think>")
    return reasoning, content or None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Let me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
        ("\nLet me see.\n</think>\n\nParis.", ("Let me see.", "Paris.")),
        ("<think>\nr\n</think>\n\nc", ("r", "c")),  # a <think> the model repeats
        ("still thinking\n\n", ("still thinking", "")),  # cut off: all reasoning, as vLLM
        ("", ("", "")),
        ("</think>\n\nHi", ("", "Hi")),
        (" a</think>b</think>c", (" a", "b</think>c")),
        ("<thin", ("<thin", "")),
    ],
)
def test_split_reasoning_opened(text, expected) -> None:
    assert split_reasoning(text, True, opened=True) == expected
    r, c = deepseek_r1(text)
    assert expected == (r.strip("\n"), (c or "").lstrip("\n"))  # the template's trimming
    assert run_stream(text.split("\n"), opened=True, keep_separators=True) == expected


@FAST
@given(st.data())
def test_stream_equals_whole_opened(data) -> None:
    text = data.draw(outputs())
    assert run_stream(_splits(data, text), opened=True) == split_reasoning(text, opened=True)
    body = text.lstrip()
    body = body if body.startswith("<think>") else text
    if "<think>" not in body[1:]:  # vLLM drops a <think> anywhere; here only a leading one
        r, c = deepseek_r1(body)
        assert split_reasoning(text, opened=True) == (r.strip("\n"), (c or "").lstrip("\n"))
