"""`response_format: json_object` (or `json_schema`): which token ids keep the output a prefix of
one JSON object (or of a value valid for the schema, kipp_core/schema_prefix.py).

Tokens are read as bytes in Latin-1, one character per byte: JSON's structure is ASCII, and every
byte >= 0x80 is part of a multi-byte character, which JSON allows only inside strings. Latin-1
characters >= U+0080 are plain string characters to `JsonPrefix` and invalid anywhere else, so the
byte view accepts exactly what the UTF-8 text would, without waiting for characters to complete.

A mask depends only on the `JsonPrefix` state, so masks are cached by it. Computing one tests each
group of tokens sharing a first character (after leading whitespace) once, then each token of the
groups that pass; in strings, tokens without `"`, `\\` or control characters pass unchecked.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kipp_core.json_prefix import JsonPrefix, State
from kipp_core.schema_prefix import SchemaPrefix
from kipp_core.tokenizer import Tokenizer

_PLAIN = re.compile(r'[^"\\\x00-\x1f]+\Z')
_CACHE_SIZE = 256  # masks of vocab_size bools: ~150 KB each for Qwen3
_WS = " \t\n\r"
MAX_WS_RUN = 21


def _group_key(text: str) -> str:
    body = text.lstrip(_WS)
    return text[: len(text) - len(body) + 1]  # leading whitespace plus the first character


class TokenTable:
    """Per tokenizer: each token's text for the constraint, and the masks computed so far."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.vocab_size = vocab_size  # the model's (logits) size, >= the tokenizer's
        n = min(tokenizer.vocab_size, vocab_size)
        self.texts = [""] * vocab_size
        for i in range(n):
            if i not in tokenizer.special_ids:  # special tokens are never JSON text
                self.texts[i] = tokenizer.token_bytes([i]).decode("latin-1")
        self.plain = np.zeros(vocab_size, dtype=bool)
        self.whitespace = np.zeros(vocab_size, dtype=bool)
        self.lengths = np.array([len(t) for t in self.texts], dtype=np.int64)
        groups: dict[str, list[int]] = {}
        self.in_string: list[int] = []  # non-plain tokens, checked one by one inside strings
        for i, text in enumerate(self.texts):
            if not text:
                continue
            if _PLAIN.match(text):
                self.plain[i] = True
            else:
                self.in_string.append(i)
            if not text.strip(_WS):
                self.whitespace[i] = True
            groups.setdefault(_group_key(text), []).append(i)
        self.groups = list(groups.items())
        self._masks: OrderedDict[tuple, np.ndarray] = OrderedDict()

    @functools.cached_property
    def ids_by_text(self) -> dict[str, list[int]]:
        """Token ids by their text (for masks of fixed text, tool_constraint.py)."""
        index: dict[str, list[int]] = {}
        for i, text in enumerate(self.texts):
            if text:
                index.setdefault(text, []).append(i)
        return index

    def mask(self, prefix: JsonPrefix | SchemaPrefix) -> np.ndarray:
        """Bool [vocab_size]: the tokens that keep `prefix` a prefix of a JSON object, or of a
        value valid for its schema (not eos)."""
        key = prefix._snap  # the whole immutable state (stack included) decides the mask
        m = self._masks.get(key)
        if m is not None:
            self._masks.move_to_end(key)
            return m
        m = self._compute(prefix)
        self._masks[key] = m
        if len(self._masks) > _CACHE_SIZE:
            self._masks.popitem(last=False)
        return m

    def _compute(self, prefix: JsonPrefix | SchemaPrefix) -> np.ndarray:
        if prefix.is_complete:
            return self.whitespace.copy()  # and the stop tokens, added per request
        texts = self.texts
        if prefix.state == State.STRING:
            m = self.plain.copy()
            for i in self.in_string:
                if prefix.can_feed(texts[i]):
                    m[i] = True
            return m
        m = np.zeros(self.vocab_size, dtype=bool)
        for key, ids in self.groups:
            if not prefix.can_feed(key):
                continue
            for i in ids:
                if len(texts[i]) == len(key) or prefix.can_feed(texts[i]):
                    m[i] = True
        return m


@dataclass
class _Stream:
    prefix: JsonPrefix | SchemaPrefix
    num_read: int = 0  # output tokens read so far
    active: bool = False  # past `start_after`
    ws_run: int = 0  # whitespace characters since the last JSON text outside strings


class JsonConstraint:
    """One request's json_object constraint (or, with `schema`, a compiled json_schema node: a
    value valid for it), per completion stream. With `start_after` (the `</think>` token when
    thinking is on) the output is free until that token.

    As llama.cpp's json.gbnf does, whitespace is bounded: none before the object, and at most
    MAX_WS_RUN characters of whitespace-only tokens in a row (a newline and 20 of indentation),
    so that a model cannot fill max_tokens with blanks.
    """

    def __init__(self, table: TokenTable, start_after: int | None = None, schema=None):
        self.table = table
        self.start_after = start_after
        self.schema = schema
        self._streams: dict[int, _Stream] = {}

    def allowed(
        self, stream: int, output_token_ids: Sequence[int], stop_token_ids: Sequence[int]
    ) -> np.ndarray | None:
        """The mask for the next token of `stream`, or None while unconstrained."""
        st = self._advance(stream, output_token_ids)
        if st is None or not st.active:
            return None
        t = self.table
        budget = 0 if st.prefix.state == State.START else MAX_WS_RUN - st.ws_run
        m = t.mask(st.prefix) & ~(t.whitespace & (t.lengths > budget))
        if st.prefix.may_end:
            m[[i for i in stop_token_ids if 0 <= i < m.size]] = True  # it may end here
        return m

    def read(self, stream: int, output_token_ids: Sequence[int]) -> bool:
        """Read `stream`'s output so far; whether it now holds the whole object."""
        st = self._advance(stream, output_token_ids)
        return st is not None and st.prefix.is_complete

    def _advance(self, stream: int, output_token_ids: Sequence[int]) -> _Stream | None:
        st = self._streams.get(stream)
        if st is None:
            prefix = JsonPrefix() if self.schema is None else SchemaPrefix(self.schema)
            st = self._streams[stream] = _Stream(prefix, active=self.start_after is None)
        for tok in output_token_ids[st.num_read :]:
            if not st.active:
                st.active = tok == self.start_after
            elif not self._read(st, self.table.texts[tok]):
                return None  # cannot happen with the mask applied; do not make it worse
        st.num_read = len(output_token_ids)
        return st

    @staticmethod
    def _read(st: _Stream, text: str) -> bool:
        if not st.prefix.feed(text):
            return False
        if st.prefix.state in (State.STRING, State.ESCAPE, State.HEX):
            st.ws_run = 0
        else:
            body = text.rstrip(_WS)
            st.ws_run = st.ws_run + len(text) if not body else len(text) - len(body)
        return True
