"""tool_choice "required" (and a named function, whose opening the prompt forces): random walks
under the masks always spell one call that the tool parser reads, with one of the offered names
and a JSON object of arguments."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kipp_core.json_constraint import TokenTable
from kipp_core.registry import IM_END_ID
from kipp_core.server.tool_parser import parse_tool_calls
from kipp_core.tokenizer import Tokenizer
from kipp_core.tool_constraint import ToolCallConstraint

VOCAB = 151936
NAMES = ["get_weather", "get_time", "météo"]


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path)


@pytest.fixture(scope="module")
def table(tok):
    return TokenTable(tok, VOCAB)


def _walk(table, tok, rng, names=NAMES, opened=False):
    end = tok.token_to_id("</tool_call>")
    c = ToolCallConstraint(table, names, end, opened)
    short = table.lengths <= 2
    closing = short & np.array([bool(set(t) & set('"}]:,')) for t in table.texts])
    out: list[int] = []
    for _ in range(400):
        m = c.allowed(0, out, [IM_END_ID])
        assert m.any()
        if m[IM_END_ID]:
            assert m.sum() == 1  # after the call: only the stop token
            return tok.decode(out), True
        pool = np.flatnonzero(m & (closing if rng.random() < 0.6 else short))
        out.append(int(rng.choice(list(pool if pool.size else np.flatnonzero(m)))))
    return tok.decode(out), False


def test_random_walks_spell_one_parsable_call(table, tok):
    rng = random.Random(1)
    seen = set()
    for _ in range(12):
        text, done = _walk(table, tok, rng)
        assert done, text
        content, [call] = parse_tool_calls("<tool_call>\n" + text)
        assert not content and call.name in NAMES, text
        assert isinstance(json.loads(call.arguments), dict)
        assert text.endswith("}\n</tool_call>")
        seen.add(call.name)
    assert len(seen) > 1  # not one name forced


def test_each_step_allows_exactly_the_consistent_tokens(table, tok):
    """The name part, checked against every token one by one: a token is allowed exactly when
    the text so far plus its text is a prefix of some opening."""
    c = ToolCallConstraint(table, NAMES, tok.token_to_id("</tool_call>"))
    out = tok.encode('{"name": "get_')
    m = c.allowed(0, out, [IM_END_ID])
    so_far = '{"name": "get_'
    want = np.array(
        [bool(t) and any(o.startswith(so_far + t) for o in c.openings) for t in table.texts]
    )
    np.testing.assert_array_equal(m, want)
    assert m[tok.encode("time")].all() and not m[tok.encode("date")].any()


def test_a_named_function_starts_at_its_arguments(table, tok):
    """opened: the prompt already ends in `"arguments": `, so the output is one JSON object, then
    the call's close; the parser reads it with that opening prepended."""
    opening = '<tool_call>\n{"name": "get_time", "arguments": '
    rng = random.Random(2)
    for _ in range(8):
        text, done = _walk(table, tok, rng, ["get_time"], opened=True)
        assert done, text
        content, [call] = parse_tool_calls(opening + text)
        assert not content and call.name == "get_time"
        assert isinstance(json.loads(call.arguments), dict), text
    c = ToolCallConstraint(table, ["get_time"], tok.token_to_id("</tool_call>"), opened=True)
    first = c.allowed(0, [], [IM_END_ID])
    assert first[tok.encode("{")].all()
    assert not first[tok.encode("[")].any() and not first[tok.encode("hello")].any()
    assert not first[IM_END_ID]
