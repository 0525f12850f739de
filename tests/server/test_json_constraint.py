"""The json_object and json_schema token masks: equal to testing every token one by one, and random
walks under the mask end in text that `json.loads` reads as an object (and that the jsonschema
package validates against the schema)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from kipp_core.json_prefix import JsonPrefix
from kipp_core.json_schema import compile_schema
from kipp_core.registry import IM_END_ID
from kipp_core.schema_prefix import SchemaPrefix
from kipp_core.server.json_constraint import MAX_WS_RUN, JsonConstraint, TokenTable
from kipp_core.tokenizer import Tokenizer

VOCAB = 151936  # kipp-tiny's logits, past the tokenizer's 151669 ids


@pytest.fixture(scope="module")
def table(tiny_path):
    return TokenTable(Tokenizer(tiny_path), VOCAB)


@pytest.mark.parametrize(
    "text",
    ['', '{', '{"ke', '{"a"', '{"a": ', '{"a": -', '{"a": 1', '{"a": 1.', '{"a": 1e', '{"a": t',
     '{"a": "x\\', '{"a": "\\u00', '{"a": [', '{"a": [1, {"b": [', '{"a": {}', '{"a": 1}'],
)  # fmt: skip
def test_mask_equals_token_by_token(table, text):
    prefix = JsonPrefix()
    assert prefix.feed(text)
    want = np.array([bool(t) and prefix.can_feed(t) for t in table.texts])
    if prefix.is_complete:
        want &= table.whitespace
    np.testing.assert_array_equal(table.mask(prefix), want)
    assert not table.mask(prefix)[[IM_END_ID, 151643]].any()  # special tokens: never JSON text


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
    assert done >= 10


def test_whitespace_is_bounded(table):
    c = JsonConstraint(table)
    ws = [i for i in range(VOCAB) if table.whitespace[i]]
    assert not c.allowed(0, [], [IM_END_ID])[ws].any()  # nothing before the object
    brace = table.texts.index("{")
    space = table.texts.index(" ")
    out = [brace] + [space] * MAX_WS_RUN
    assert c.allowed(0, out[:-1], [])[space]
    assert not c.allowed(0, out, [])[space]
    assert not c.allowed(0, out, [])[ws].any()


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
    """The grouped and in-string shortcuts of TokenTable.mask hold for schema states too (keys
    from a fixed set are not free strings)."""
    prefix = SchemaPrefix(compile_schema(SCHEMA))
    assert prefix.feed(text)
    want = np.array([bool(t) and prefix.can_feed(t) for t in table.texts])
    np.testing.assert_array_equal(table.mask(prefix), want)


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
                done += 1
                break
            pool = np.flatnonzero(m & (closing if rng.random() < 0.7 else short))
            out.append(int(rng.choice(list(pool if pool.size else np.flatnonzero(m)))))
    assert done >= 6
