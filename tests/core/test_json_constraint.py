"""The json_object and json_schema token masks: equal to testing every token one by one against
the JSON automaton and llama.cpp's whitespace rule (json.gbnf: `ws ::= | " " | "\\n" [ \\t]{0,20}`,
checked here by a scanner of its own), and random walks under the mask end in text that
`json.loads` reads as an object (and that the jsonschema package validates against the schema).
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from kipp_core.json_constraint import MAX_INDENT, JsonConstraint, TokenTable, read
from kipp_core.json_prefix import JsonPrefix
from kipp_core.json_schema import compile_schema
from kipp_core.registry import IM_END_ID
from kipp_core.schema_prefix import SchemaPrefix
from kipp_core.tokenizer import Tokenizer

VOCAB = 151936  # kipp-tiny's logits, past the tokenizer's 151669 ids
GBNF_WS = re.compile(r"( |\n[ \t]{0,20})?")  # json.gbnf's ws, one gap's whole run


@pytest.fixture(scope="module")
def table(tiny_path):
    return TokenTable(Tokenizer(tiny_path), VOCAB)


def _scan(text: str, state=(False, False, "", True, 0)):
    """json.gbnf's whitespace rule and its 16-digit bound over text, resumable: (in a string,
    after a backslash, the open run of whitespace outside strings, all good so far, the digits
    in a row outside strings)."""
    in_str, esc, run, ok, digits = state
    for c in text:
        digits = digits + 1 if c.isdigit() and not in_str else 0
        ok = ok and digits <= 16
        if in_str:
            esc, in_str = (False, True) if esc else (c == "\\", c != '"')
        elif c in " \t\n\r":
            run += c
            continue
        else:
            in_str = c == '"'
        ok = ok and GBNF_WS.fullmatch(run) is not None
        run = ""
    return in_str, esc, run, ok, digits


def gaps_follow_gbnf(text: str) -> bool:
    """Every run of whitespace outside strings is json.gbnf's ws, none opens the text, and no
    number has more than 16 digits in a row."""
    _, _, run, ok, _ = _scan(text)
    return ok and GBNF_WS.fullmatch(run) is not None and not text[:1].isspace()


def _brute(table: TokenTable, make, text: str) -> np.ndarray:
    """Token by token: the automaton reads the token after `text`, and the whitespace rule holds
    for the text so far plus it."""
    base, head = make(), _scan(text)
    assert base.feed(text)
    want = np.zeros(VOCAB, dtype=bool)
    for i, t in enumerate(table.texts):
        if t and base.can_feed(t) and not (text + t)[:1].isspace():
            _, _, run, ok, _ = _scan(t, head)
            want[i] = ok and GBNF_WS.fullmatch(run) is not None
    return want


def _state(make, text: str):
    """(prefix, whitespace state) after text, as a constrained stream holds them."""
    return read(make(), 0, text)


@pytest.mark.parametrize(
    "text",
    ['', '{', '{"ke', '{"a"', '{"a": ', '{"a": -', '{"a": 1', '{"a": 1.', '{"a": 1e', '{"a": t',
     '{"a": "x\\', '{"a": "\\u00', '{"a": [1, {"b": [', '{"a": 1}', '{\n  ',
     '{"a":\n' + ' ' * MAX_INDENT, '{ ', '{"a": 1}\n', '{"a": " x', '{"a": ' + '9' * 15],
)  # fmt: skip
def test_mask_equals_token_by_token(table, text):
    prefix, ws = _state(JsonPrefix, text)
    np.testing.assert_array_equal(table.mask(prefix, ws), _brute(table, JsonPrefix, text))
    assert not table.mask(prefix, ws)[[IM_END_ID, 151643]].any()  # special tokens: never text


def _walk(table: TokenTable, rng: random.Random) -> tuple[str, bool]:
    """Pick allowed tokens at random, favouring short ones that close things, until eos."""
    short = table.lengths <= 2
    closing = short & np.array([bool(set(t) & set('"}]:,')) for t in table.texts])
    c = JsonConstraint(table)
    out: list[int] = []
    for _ in range(300):
        m = c.allowed(0, out, [IM_END_ID])
        if m[IM_END_ID]:
            return table_text(table, out), True
        pool = np.flatnonzero(m & (closing if rng.random() < 0.6 else short))
        out.append(int(rng.choice(list(pool if pool.size else np.flatnonzero(m)))))
    return table_text(table, out), False


def table_text(table: TokenTable, ids: list[int]) -> str:
    return "".join(table.texts[i] for i in ids).encode("latin-1").decode("utf-8", "replace")


def test_random_walks_under_the_mask_parse(table):
    rng = random.Random(0)
    done = 0
    for _ in range(20):
        text, complete = _walk(table, rng)
        if complete:
            done += 1
            assert isinstance(json.loads(text), dict), text
            assert gaps_follow_gbnf(text), text
    assert done >= 10


def test_whitespace_is_bounded(table):
    """json.gbnf's gaps: nothing before the object, then per gap nothing, one space, or a newline
    with at most 20 spaces or tabs; no tab or carriage return alone, no second newline."""
    c = JsonConstraint(table)
    ws = [i for i, t in enumerate(table.texts) if t and not t.strip(" \t\n\r")]
    assert not c.allowed(0, [], [IM_END_ID])[ws].any()  # nothing before the object
    ids = {t: table.texts.index(t) for t in ("{", " ", "\n", "\t", "\r", "  ", "\n\n")}
    m = c.allowed(0, [ids["{"]], [])
    assert m[ids[" "]] and m[ids["\n"]]
    assert not m[ids["\t"]] and not m[ids["\r"]] and not m[ids["  "]] and not m[ids["\n\n"]]
    assert not c.allowed(1, [ids["{"], ids[" "]], [])[ws].any()  # a space closes the gap
    out = [ids["{"], ids["\n"]] + [ids[" "]] * MAX_INDENT
    assert c.allowed(2, out[:-1], [])[ids["\t"]]
    assert not c.allowed(2, out, [])[ws].any()  # 20 of indentation


def test_free_until_the_start_token(table):
    c = JsonConstraint(table, start_after=151668)
    assert c.allowed(0, [5, 6, 7], [IM_END_ID]) is None
    m = c.allowed(0, [5, 6, 7, 151668], [IM_END_ID])
    assert m is not None and m[table.texts.index("{")] and not m[IM_END_ID]


# -- json_schema ----------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"enum": ["C", "F"]},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "text", ["", "{", '{"', '{"ci', '{"city": "Pa', '{"city": "P", "da', '{"days": 1', '{"unit": "',
             '{"days": 2, "city": "x"', '{"alerts": [true, '],
)  # fmt: skip
def test_schema_mask_equals_token_by_token(table, text):
    """The trie walk, its fixed-text (keys, enum members) and in-string shortcuts hold for schema
    states too (keys from a fixed set are not free strings)."""
    node = compile_schema(SCHEMA)
    prefix, ws = _state(lambda: SchemaPrefix(node), text)
    want = _brute(table, lambda: SchemaPrefix(node), text)
    np.testing.assert_array_equal(table.mask(prefix, ws), want)


def test_random_walks_under_a_schema_validate(table):
    """Random tokens under the masks, favouring short closing ones, spell documents that the
    jsonschema package validates."""
    rng = random.Random(3)
    short = table.lengths <= 2
    closing = short & np.array([bool(set(t) & set('"}]:,')) for t in table.texts])
    done = 0
    for _ in range(10):
        c = JsonConstraint(table, schema=compile_schema(SCHEMA))
        out: list[int] = []
        for _ in range(300):
            m = c.allowed(0, out, [IM_END_ID])
            if m[IM_END_ID]:
                text = table_text(table, out)
                jsonschema.validate(json.loads(text), SCHEMA)
                assert gaps_follow_gbnf(text), text
                done += 1
                break
            pool = np.flatnonzero(m & (closing if rng.random() < 0.7 else short))
            out.append(int(rng.choice(list(pool if pool.size else np.flatnonzero(m)))))
    assert done >= 6


BIG_ENUM = {
    "type": "object",
    "properties": {
        "pick": {"enum": [f"{w}{i}" for i, w in enumerate(["the", "a b", "é", 'x"y'] * 500)]}
    },
    "required": ["pick"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("text", ['{"pick": ', '{"pick":"', '{"pick": "th', '{"pick": "a b1'])
def test_a_large_enums_masks_equal_token_by_token(table, text):
    """The fixed-text walk (members met branch by branch with the vocabulary, no automaton
    state until a member ends) against the automaton read token by token, 2,000 members."""
    node = compile_schema(BIG_ENUM)
    prefix, ws = _state(lambda: SchemaPrefix(node), text)
    want = _brute(table, lambda: SchemaPrefix(node), text)
    np.testing.assert_array_equal(table.mask(prefix, ws), want)
