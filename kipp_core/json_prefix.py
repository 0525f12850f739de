"""Incremental check that text is a prefix of a JSON object, for `response_format: json_object`.

A pushdown automaton: one small state, a stack of open containers ("{" / "["), a flag for object
keys and the characters still owed by a literal or a `\\uXXXX` escape. The whole state is one
immutable tuple, so `copy()` is free and `can_feed()` never touches the text read so far: a decoder
can try thousands of candidate token strings per step at a few comparisons per character.
"""

from __future__ import annotations

import enum
import re


class State(enum.IntEnum):
    START = 0  # before the top-level "{"
    OBJ_FIRST = 1  # after "{": a key or "}"
    OBJ_KEY = 2  # after "," in an object: a key
    COLON = 3  # after a key
    VALUE = 4  # after ":" or "," in an array
    ARR_FIRST = 5  # after "[": a value or "]"
    AFTER = 6  # after a value in a container: ",", or the container's closer
    STRING = 7
    ESCAPE = 8  # after a backslash in a string
    HEX = 9  # inside \uXXXX
    LITERAL = 10  # inside true / false / null
    MINUS = 11  # numbers: after "-"
    ZERO = 12  # a leading 0 (no more integer digits allowed)
    INT = 13
    FRAC0 = 14  # after "." (a digit must follow)
    FRAC = 15
    EXP0 = 16  # after "e" / "E"
    EXP_SIGN = 17  # after the exponent's sign
    EXP = 18
    DONE = 19  # the top-level object is closed: only whitespace may follow


S = State
_WS = " \t\n\r"
_WS_OK = frozenset(  # states that may read whitespace
    {S.START, S.OBJ_FIRST, S.OBJ_KEY, S.COLON, S.VALUE, S.ARR_FIRST, S.AFTER, S.DONE}
)
_ENDS_NUMBER = frozenset({S.ZERO, S.INT, S.FRAC, S.EXP})  # states where a number may stop
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_HEX_OWED = "####"  # one placeholder per hex digit still owed
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # a run of string characters that need no state change


def _number_table() -> dict[State, dict[str, State]]:
    digits = "0123456789"
    table: dict[State, dict[str, State]] = {s: {} for s in range(S.MINUS, S.EXP + 1)}
    table[S.MINUS] = {"0": S.ZERO, **{d: S.INT for d in digits[1:]}}
    for s in (S.INT, S.FRAC, S.EXP):
        table[s].update({d: s for d in digits})
    table[S.FRAC0] = {d: S.FRAC for d in digits}
    table[S.EXP0] = {"+": S.EXP_SIGN, "-": S.EXP_SIGN, **{d: S.EXP for d in digits}}
    table[S.EXP_SIGN] = {d: S.EXP for d in digits}
    for s in (S.ZERO, S.INT):
        table[s]["."] = S.FRAC0
    for s in (S.ZERO, S.INT, S.FRAC):
        table[s].update({"e": S.EXP0, "E": S.EXP0})
    return table


_NUMBER = _number_table()

# (state, open containers, string-is-a-key, characters owed by a literal or \u escape)
Snapshot = tuple[State, str, bool, str]
_INITIAL: Snapshot = (S.START, "", False, "")


def _start_value(c: str, stack: str) -> Snapshot | None:
    """The state after the first character of a value."""
    if c == "{":
        return S.OBJ_FIRST, stack + "{", False, ""
    if c == "[":
        return S.ARR_FIRST, stack + "[", False, ""
    if c == '"':
        return S.STRING, stack, False, ""
    if c in _LITERALS:
        return S.LITERAL, stack, False, _LITERALS[c]
    if c == "-":
        return S.MINUS, stack, False, ""
    if c in _NUMBER[S.MINUS]:  # a digit: "0" gives ZERO, 1-9 give INT
        return _NUMBER[S.MINUS][c], stack, False, ""
    return None


def _structural(state: State, stack: str, c: str) -> Snapshot | None:
    """Punctuation and value starts: every state outside strings, literals and numbers."""
    top = stack[-1:]
    if c in "}]" and (
        state == S.AFTER or state == S.OBJ_FIRST and c == "}" or state == S.ARR_FIRST and c == "]"
    ):
        if (top == "{") != (c == "}"):
            return None
        stack = stack[:-1]
        return (S.AFTER if stack else S.DONE), stack, False, ""
    if state == S.AFTER:
        if c != ",":
            return None
        return (S.OBJ_KEY if top == "{" else S.VALUE), stack, False, ""
    if state == S.OBJ_FIRST or state == S.OBJ_KEY:
        return (S.STRING, stack, True, "") if c == '"' else None
    if state == S.COLON:
        return (S.VALUE, stack, False, "") if c == ":" else None
    if state == S.VALUE or state == S.ARR_FIRST:
        return _start_value(c, stack)
    if state == S.START:
        return (S.OBJ_FIRST, "{", False, "") if c == "{" else None
    return None  # DONE: only whitespace may follow


def _advance(snap: Snapshot, text: str) -> Snapshot | None:
    """The state after reading `text`, or None if no JSON object starts with what was read."""
    state, stack, key, owed = snap
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if state == S.STRING:
            run = _PLAIN.match(text, i)
            if run:  # skip ordinary characters in one step
                i = run.end()
                continue
            if c == '"':
                state = S.COLON if key else S.AFTER
            elif c == "\\":
                state = S.ESCAPE
            else:
                return None  # a raw control character
            i += 1
            continue
        i += 1
        if state >= S.MINUS and state != S.DONE:
            nxt = _NUMBER[state].get(c)
            if nxt is not None:
                state = nxt
                continue
            if state not in _ENDS_NUMBER:
                return None
            state = S.AFTER  # the number ended; c is read below as what follows it
        if c in _WS:
            if state in _WS_OK:
                continue
            return None
        if state == S.ESCAPE:
            if c == "u":
                state, owed = S.HEX, _HEX_OWED
            elif c in _ESCAPES:
                state = S.STRING
            else:
                return None
        elif state == S.HEX:
            if c not in _HEX:
                return None
            owed = owed[1:]
            if not owed:
                state = S.STRING
        elif state == S.LITERAL:
            if c != owed[0]:
                return None
            owed = owed[1:]
            if not owed:
                state = S.AFTER
        else:
            nxt_snap = _structural(state, stack, c)
            if nxt_snap is None:
                return None
            state, stack, key, owed = nxt_snap
    return state, stack, key, owed


class JsonPrefix:
    """Accepts text piece by piece while it stays a prefix of some JSON object."""

    __slots__ = ("_snap",)

    def __init__(self, snap: Snapshot = _INITIAL) -> None:
        self._snap = snap

    def feed(self, text: str) -> bool:
        """Read `text`; on False (no JSON object could start so) the state is left unchanged."""
        nxt = _advance(self._snap, text)
        if nxt is None:
            return False
        self._snap = nxt
        return True

    def can_feed(self, text: str) -> bool:
        return _advance(self._snap, text) is not None

    def fed(self, text: str) -> JsonPrefix | None:
        """A new prefix with `text` read, or None if it cannot be (this one is unchanged)."""
        nxt = _advance(self._snap, text)
        return None if nxt is None else JsonPrefix(nxt)

    def copy(self) -> JsonPrefix:
        return JsonPrefix(self._snap)  # the snapshot is immutable, so sharing it is safe

    @property
    def at_gap(self) -> bool:
        """Between JSON tokens: whitespace changes nothing here."""
        return self._snap[0] in _WS_OK

    def next_chars(self) -> None:
        """(SchemaPrefix's interface: the characters that may come next are not listed here.)"""
        return None

    def fixed(self) -> None:
        """(SchemaPrefix's interface: no fixed texts here.)"""
        return None

    @property
    def in_string(self) -> bool:
        """Inside a string: whitespace here is its text, not JSON's."""
        return self._snap[0] in (S.STRING, S.ESCAPE, S.HEX)

    @property
    def state(self) -> State:
        return self._snap[0]

    @property
    def depth(self) -> int:
        return len(self._snap[1])

    @property
    def is_complete(self) -> bool:
        """The text so far is one whole JSON object, possibly followed by whitespace."""
        return self._snap[0] == S.DONE

    may_end = is_complete  # (an object cannot go on once whole; json_schema's scalars can)
