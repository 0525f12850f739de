"""JsonPrefix against json.dumps output and a brute-force oracle built on json.loads."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kipp_core.json_prefix import JsonPrefix, State

FAST = settings(max_examples=200, deadline=None)

# Oracle: p is a valid prefix iff json.loads(p + a + b + closers) gives a dict for some pair below.
# `a` finishes whatever token p ends inside (string, escape, \u, literal, number) and `b` supplies
# what the grammar still needs (a key's value, a value after ":" or ",", a whole top-level object).
# The closers come from a naive bracket scan. Every valid prefix has a completion of this shape.
_FINISH_TOKEN = [
    "",
    '"',
    'n"',
    '0"',
    '00"',
    '000"',
    '0000"',
    "0",
    "e",
    "ue",
    "rue",
    "l",
    "ll",
    "ull",
    "se",
    "lse",
    "alse",
]
_FILL = ["", ":0", '"k":0', "0", "{}"]
_CLOSE = {"{": "}", "[": "]"}


def _reject_constant(name: str) -> None:
    raise ValueError(name)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text, parse_constant=_reject_constant), dict)
    except (ValueError, RecursionError):
        return False


def _naive_closers(text: str) -> str | None:
    """Closing brackets for the open containers, or None if `text` ends inside a string."""
    stack: list[str] = []
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            stack.append(c)
        elif c in "}]" and stack:
            stack.pop()
    return None if in_string else "".join(_CLOSE[c] for c in reversed(stack))


def oracle_is_prefix(prefix: str) -> bool:
    for a, b in itertools.product(_FINISH_TOKEN, _FILL):
        closers = _naive_closers(prefix + a + b)
        if closers is not None and _is_object(prefix + a + b + closers):
            return True
    return False


def accepted_len(text: str) -> int:
    """How many leading characters JsonPrefix accepts, fed one at a time."""
    jp = JsonPrefix()
    for i, c in enumerate(text):
        if not jp.feed(c):
            return i
    return len(text)


# ---- generated JSON -------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
_objects = st.dictionaries(st.text(max_size=5), _values, max_size=5)
_ws = st.text(alphabet=" \t\n\r", max_size=3)


@st.composite
def json_texts(draw) -> str:
    """A JSON object as json.dumps may write it, with random layout and surrounding whitespace."""
    seps = draw(st.sampled_from([None, (",", ":"), (", ", ": "), (" ,", " : ")]))
    indent = draw(st.sampled_from([None, 0, 2, "\t"]))
    body = json.dumps(
        draw(_objects), ensure_ascii=draw(st.booleans()), indent=indent, separators=seps
    )
    return draw(_ws) + body + draw(_ws)


def _chunks(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@FAST
@given(json_texts())
def test_every_prefix_of_valid_json_is_accepted(text: str) -> None:
    last_brace = text.rindex("}")
    jp = JsonPrefix()
    for i, c in enumerate(text):
        assert jp.feed(c), (text, i)
        assert jp.is_complete == (i >= last_brace)
    assert jp.is_complete


@FAST
@given(st.data())
def test_chunked_feeding_matches(data) -> None:
    text = data.draw(json_texts())
    jp = JsonPrefix()
    for chunk in _chunks(data.draw, text):
        assert jp.feed(chunk)
    assert jp.is_complete
    assert not jp.can_feed("x") and jp.can_feed(" \n")


_MUTATION_CHARS = '{}[]":,.-+eE019 tfnrulas\\u\nx\x01\x7f'
_mutations = st.lists(
    st.tuples(
        st.integers(0, 10**6),
        st.sampled_from(["insert", "delete", "replace"]),
        st.sampled_from(_MUTATION_CHARS),
    ),
    min_size=1,
    max_size=3,
)


def _mutate(text: str, mutations) -> str:
    for pos, op, c in mutations:
        i = pos % (len(text) + 1)
        if op == "insert":
            text = text[:i] + c + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + 1 :]
        else:
            text = text[:i] + c + text[i + 1 :]
    return text


def _check_against_oracle(text: str) -> None:
    n = accepted_len(text)
    assert oracle_is_prefix(text[:n]), f"accepted but not completable: {text[:n]!r}"
    if n < len(text):
        assert not oracle_is_prefix(text[: n + 1]), f"rejected a valid prefix: {text[: n + 1]!r}"
    jp = JsonPrefix()
    jp.feed(text[:n])
    assert jp.is_complete == _is_object(text[:n])


@FAST
@given(json_texts(), _mutations)
def test_mutated_json_matches_oracle(text: str, mutations) -> None:
    _check_against_oracle(_mutate(text, mutations))


@FAST
@given(st.text(alphabet='{}[]":,.-+eE01 tfnrulas\\ux', max_size=14))
def test_random_strings_match_oracle(tail: str) -> None:
    _check_against_oracle("{" + tail)  # a leading "{" gets past the top-level check more often


VALID = [
    "{}",
    " \n\t\r{ }",
    '{"a":-0.5e+10}',
    '{"a":0}',
    '{"a":-0}',
    '{"a":1E5}',
    '{"a":1e-0}',
    '{"a":[]}',
    '{"a":[{}, [], "x", true, false, null, 0.25]}',
    '{"a":"\\u00e9\\"\\\\\\/\\b\\f\\n"}',
    '{"ü": "日本語 \U0001f600"}',
    '{"a":{"b":{"c":[[[]]]}}} \n',
    '{"":""}',
]
INVALID = [
    '{"a" 1}',
    "{,}",
    "[1]",
    '"s"',
    "1",
    "true",
    '{"a":01}',
    '{"a":tru}x',
    '{"a":tx',
    '{"a":"\x01"}',
    '{"a":"\n"}',
    '{"a":1.}',
    '{"a":.5}',
    '{"a":-}',
    '{"a":1e}',
    '{"a":1e+}',
    '{"a":+1}',
    '{"a":1,}',
    '{"a":[1,]}',
    '{"a":[1}',
    '{"a":{]}',
    "{}x",
    "{} {}",
    '{"a":"\\x"}',
    '{"a":"\\u12g4"}',
    "{'a':1}",
    '{"a":NaN}',
    '{"a":Infinity}',
    "{a:1}",
    '{"a"::1}',
    '{"a":1 2}',
    "\ufeff{}",
    "\u00a0{}",
    '{"a":1\u00a0}',
    '{"a":\u0661}',
    "{}}",
    '{"a":nul}',
    '{"a":[,1]}',
]


@pytest.mark.parametrize("text", VALID)
def test_valid_cases(text: str) -> None:
    jp = JsonPrefix()
    assert jp.feed(text) and jp.is_complete
    assert _is_object(text)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_cases(text: str) -> None:
    assert not JsonPrefix().feed(text)
    assert accepted_len(text) < len(text)
    assert not oracle_is_prefix(text)


def test_prefixes_are_not_complete() -> None:
    for text in ['{"a":1', '{"a":tru', '{"a":"x', '{"a":[', '{"a":-', "  ", "", '{"a":1.5e']:
        jp = JsonPrefix()
        assert jp.feed(text) and not jp.is_complete, text


def test_rejected_feed_leaves_state_unchanged() -> None:
    jp = JsonPrefix()
    assert jp.feed('{"a": [1, ')
    assert not jp.feed("2, }")  # the valid "2, " part must not stick either
    assert jp.state is State.VALUE and jp.depth == 2
    assert jp.feed("2]}") and jp.is_complete


def test_can_feed_and_copy_do_not_mutate() -> None:
    jp = JsonPrefix()
    jp.feed('{"k": "v')
    before = jp.state
    assert jp.can_feed('"}') and not jp.can_feed("\x00")
    assert jp.state is before and not jp.is_complete
    twin = jp.copy()
    assert twin.feed('"}') and twin.is_complete
    assert not jp.is_complete and jp.feed('w"}') and jp.is_complete


def test_empty_feed_is_accepted() -> None:
    jp = JsonPrefix()
    assert jp.feed("") and jp.state is State.START


def test_whitespace_only_after_complete() -> None:
    jp = JsonPrefix()
    assert jp.feed("{}")
    for c in ',}]{x0"':
        assert not jp.can_feed(c)
    assert jp.feed(" \t\r\n") and jp.is_complete
