"""`response_format: json_object` (or `json_schema`): which token ids keep the output a prefix of
one JSON object (or of a value valid for the schema, kipp_core/schema_prefix.py).

Tokens are read as bytes in Latin-1, one character per byte: JSON's structure is ASCII, and every
byte >= 0x80 is part of a multi-byte character, which JSON allows only inside strings. Latin-1
characters >= U+0080 are plain string characters to `JsonPrefix` and invalid anywhere else, so the
byte view accepts exactly what the UTF-8 text would, without waiting for characters to complete.

Whitespace outside strings follows llama.cpp's json.gbnf (`ws ::= | " " | "\\n" [ \\t]{0,20}`):
none before the value, and between two JSON tokens nothing, one space, or one newline with at
most 20 spaces or tabs of indentation; and a number's runs of digits are at most 16 long (the
grammar's integer part, `[1-9] [0-9]{0,15}`, here for the fraction and exponent too), so that a
model cannot fill max_tokens with blanks or digits.

A mask depends only on the (prefix state, run state) pair, so masks are cached by it.
Computing one walks the vocabulary as a trie (the token texts sorted, a node a range of them
sharing a prefix) together with the automaton: a character the automaton refuses prunes every
token under it, so the work follows what can still be written (a 9,000-member enum costs the
few tokens that spell its members, not 9,000 checks a token). Inside a free string, tokens whose
rest has no `"`, `\\` or control character pass at once.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kipp_core.json_prefix import JsonPrefix, State
from kipp_core.schema_prefix import SchemaPrefix
from kipp_core.tokenizer import Tokenizer

_CACHE_SIZE = 256  # masks of vocab_size bools: ~150 KB each for Qwen3
_MAX_STEPS = 200_000  # automaton steps kept (~100 bytes each)
_WS = " \t\n\r"
_NOT_PLAIN = frozenset('"\\') | frozenset(map(chr, range(0x20)))
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_DIGITS = frozenset("0123456789")
_OUTSIDE = frozenset('{}[],:" \t\n\r-+.eE0123456789truefalsn')  # all JSON has outside strings
_NOT_PLAIN_RE = re.compile(r'["\\\x00-\x1f]')
MAX_INDENT = 20  # json.gbnf's [ \t]{0,20} after a newline
MAX_DIGITS = 16  # json.gbnf's [1-9] [0-9]{0,15}


def _ws_next(run: int, c: str) -> int | None:
    """The gap's whitespace state after c: 1 a space (no more), 2 + k a newline and k characters
    of indentation; None where json.gbnf stops."""
    if run <= 0:
        return 1 if c == " " else 2 if c == "\n" else None
    if run >= 2 and c in " \t" and run - 2 < MAX_INDENT:
        return run + 1
    return None


def step(prefix, run: int, c: str):
    """(prefix, run) after the character c, or None where the JSON, the whitespace or the digits
    rule ends. run: 0, a gap's whitespace state (> 0), or -k after k digits of a number."""
    if c in _WS and not prefix.in_string:
        if prefix.state == State.START:
            return None  # nothing before the value
        run = _ws_next(run, c)
        if run is None:
            return None
        if prefix.at_gap:
            return prefix, run
    elif c in _DIGITS and not prefix.in_string and prefix.state != State.LITERAL:
        run = run - 1 if run < 0 else -1
        if run < -MAX_DIGITS:
            return None
    else:
        run = 0
    p = prefix.fed(c)
    return None if p is None else (p, run)


def read(prefix, run: int, text: str):
    """(prefix, run) after `text`, or None."""
    i, n = 0, len(text)
    while i < n:
        if prefix.state == State.STRING:
            plain = _PLAIN_RUN.match(text, i)
            if plain:  # string characters that change nothing: read at once
                prefix, run, i = prefix.fed(plain.group()), 0, plain.end()
                continue
        nxt = step(prefix, run, text[i])
        if nxt is None:
            return None
        prefix, run = nxt
        i += 1
    return prefix, run


def _plain_from(text: str) -> int:
    """Where the longest suffix of plain string characters starts."""
    k = len(text)
    while k and text[k - 1] not in _NOT_PLAIN:
        k -= 1
    return k


class TokenTable:
    """Per tokenizer: each token's text for the constraint, and the masks computed so far."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.vocab_size = vocab_size  # the model's (logits) size, >= the tokenizer's
        n = min(tokenizer.vocab_size, vocab_size)
        self.texts = [""] * vocab_size
        for i in range(n):
            if i not in tokenizer.special_ids:  # special tokens are never JSON text
                self.texts[i] = tokenizer.token_bytes([i]).decode("latin-1")
        self.lengths = np.array([len(t) for t in self.texts], dtype=np.int64)
        order = sorted((i for i, t in enumerate(self.texts) if t), key=self.texts.__getitem__)
        self._ids = np.array(order, dtype=np.int64)  # sorted position -> token id
        self._sorted = [self.texts[i] for i in order]
        self._plain_from = np.array([_plain_from(t) for t in self._sorted], dtype=np.int64)
        # those that a string may read whole: a '"' or '\\' before any control character
        self._string_checks = [
            j
            for j, t in enumerate(self._sorted)
            if self._plain_from[j] and t[_NOT_PLAIN_RE.search(t).start()] >= " "
        ]
        self._children: dict[tuple, dict] = {}  # (lo, hi, depth) -> {c: (a, b)}
        # the automaton's steps by (state, character, run): a gap's whitespace keeps its state,
        # and every mask from there meets the same few hundred first characters
        self._steps: dict[tuple, tuple | None] = {}
        self._masks: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the cache is shared by the engine and compile threads
        self._ids_by_text: dict[str, list[int]] | None = None

    @property
    def ids_by_text(self) -> dict[str, list[int]]:
        """Token ids by their text (for masks of fixed text, tool_constraint.py)."""
        if self._ids_by_text is None:
            index: dict[str, list[int]] = {}
            for i, text in enumerate(self.texts):
                if text:
                    index.setdefault(text, []).append(i)
            self._ids_by_text = index
        return self._ids_by_text

    def mask(self, prefix: JsonPrefix | SchemaPrefix, ws: int = 0) -> np.ndarray:
        """Bool [vocab_size], read-only: the tokens that keep `prefix` (with `ws`, the whitespace
        state of the gap it ends in) a prefix of a JSON object, or of a value valid for its
        schema (never eos)."""
        key = (prefix._snap, ws)  # the whole immutable state (stack included) decides the mask
        with self._lock:
            m = self._masks.get(key)
            if m is not None:
                self._masks.move_to_end(key)
                return m
        m = self._compute(prefix, ws)
        m.flags.writeable = False
        with self._lock:
            self._masks[key] = m
            if len(self._masks) > _CACHE_SIZE:
                self._masks.popitem(last=False)
        return m

    def _compute(self, prefix, ws: int) -> np.ndarray:
        ok = np.zeros(len(self._sorted), dtype=bool)  # by sorted position
        if prefix.state == State.STRING:
            self._in_string(prefix, ws, 0, len(self._sorted), 0, ok)
        else:
            if len(self._steps) > _MAX_STEPS:
                self._steps = {}
            self._walk(prefix, ws, 0, len(self._sorted), 0, ok)
        m = np.zeros(self.vocab_size, dtype=bool)
        m[self._ids[ok]] = True
        return m

    def _walk(self, prefix, ws, lo: int, hi: int, depth: int, ok: np.ndarray) -> None:
        """Mark the tokens of texts[lo:hi] (which share their first `depth` characters, read into
        (prefix, ws)) whose rest the automaton reads."""
        texts = self._sorted
        if len(texts[lo]) == depth:  # the token that ends here (texts are distinct)
            ok[lo] = True
            lo += 1
        fixed = prefix.fixed()
        if fixed is not None:
            self._walk_fixed(prefix, lo, hi, depth, *fixed[1:], ok)
            return
        branches = self._branches(lo, hi, depth)
        if not prefix.in_string:  # JSON's own characters only (or a literal's next ones)
            few = prefix.next_chars() or _OUTSIDE
            if len(few) < len(branches):
                branches = {c: branches[c] for c in few if c in branches}
        snap, steps = prefix._snap, self._steps
        for c, (a, b) in branches.items():
            key = (snap, c, ws if c in _WS or c in _DIGITS else 0)  # the others reset ws
            nxt = steps.get(key, steps)
            if nxt is steps:
                nxt = steps[key] = step(prefix, ws, c)
            if nxt is None:
                continue
            if nxt[0].state == State.STRING:
                self._in_string(nxt[0], nxt[1], a, b, depth + 1, ok)
            else:
                self._walk(nxt[0], nxt[1], a, b, depth + 1, ok)

    def _walk_fixed(self, base, lo, hi, depth, clo, chi, typed, ok) -> None:
        """_walk inside a string of fixed texts (base.fixed()): the vocabulary's branches and the
        texts' next characters met in step, with no automaton state made until a text ends."""
        texts, cands = self._sorted, base.fixed()[0]
        if lo < hi and len(texts[lo]) == depth:
            ok[lo] = True
            lo += 1
        if lo >= hi:
            return
        # the vocabulary's branches as known, else found for the texts' characters alone
        branches, head = self._children.get((lo, hi, depth)), texts[lo][:depth]
        n, j = len(typed), clo
        while j < chi:
            c = cands[j][n]
            end = bisect_left(cands, typed + chr(ord(c) + 1), j, chi)
            if branches is not None:
                ab = branches.get(c)
            else:
                a = bisect_left(texts, head + c, lo, hi)
                b = bisect_left(texts, head + chr(ord(c) + 1), a, hi)
                ab = (a, b) if a < b else None
            if ab is not None:
                if cands[j] == typed + c:  # a text ends with c: the automaton goes on
                    nxt = base.with_fixed(clo, chi, typed).fed(c)
                    if nxt is not None:
                        self._walk(nxt, 0, *ab, depth + 1, ok)
                else:
                    self._walk_fixed(base, *ab, depth + 1, j, end, typed + c, ok)
            j = end

    def _branches(self, lo: int, hi: int, depth: int) -> dict:
        """{c: (a, b)}: texts[a:b] are those of texts[lo:hi] whose next character is c."""
        out = self._children.get((lo, hi, depth))
        if out is None:
            texts, out, j = self._sorted, {}, lo
            while j < hi:
                t = texts[j]
                c = t[depth]
                end = bisect_left(texts, t[:depth] + chr(ord(c) + 1), j + 1, hi)
                out[c] = (j, end)
                j = end
            self._children[(lo, hi, depth)] = out
        return out

    def _in_string(self, prefix, ws: int, lo: int, hi: int, depth: int, ok: np.ndarray) -> None:
        """texts[lo:hi] from inside a free string: plain rests pass, the others are read."""
        pf = self._plain_from[lo:hi]
        ok[lo:hi] |= pf <= depth
        if depth == 0:  # (the whole vocabulary)
            checks = self._string_checks
        else:
            checks = [lo + j for j in np.flatnonzero(pf > depth)]
        for j in checks:
            text = self._sorted[j]
            if text[_NOT_PLAIN_RE.search(text, depth).start()] < " ":
                continue  # a raw control character in a string
            if read(prefix, ws, text[depth:]) is not None:
                ok[j] = True


@dataclass
class _Stream:
    prefix: JsonPrefix | SchemaPrefix
    num_read: int = 0  # output tokens read so far
    active: bool = False  # past `start_after`
    ws: int = 0  # the whitespace state of the gap the output ends in


class JsonConstraint:
    """One request's json_object constraint (or, with `schema`, a compiled json_schema node: a
    value valid for it), per completion stream. With `start_after` (the `</think>` token when
    thinking is on) the output is free until that token."""

    def __init__(self, table: TokenTable, start_after: int | None = None, schema=None):
        self.table = table
        self.start_after = start_after
        self.schema = schema
        self._streams: dict[int, _Stream] = {}

    def allowed(
        self, stream: int, output_token_ids: Sequence[int], stop_token_ids: Sequence[int]
    ) -> np.ndarray | None:
        """The mask for the next token of `stream` (read-only), or None while unconstrained."""
        st = self._advance(stream, output_token_ids)
        if st is None or not st.active:
            return None
        m = self.table.mask(st.prefix, st.ws)
        if st.prefix.may_end:
            m = m.copy()
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
                continue
            nxt = read(st.prefix, st.ws, self.table.texts[tok])
            if nxt is None:
                return None  # cannot happen with the mask applied; do not make it worse
            st.prefix, st.ws = nxt
        st.num_read = len(output_token_ids)
        return st
