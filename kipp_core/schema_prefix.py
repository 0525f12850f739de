"""Incremental check that text is a prefix of a JSON value valid for a compiled JSON schema
(json_schema.py), for `response_format: json_schema` and the arguments of forced tool calls.

`SchemaPrefix` has `JsonPrefix`'s interface, so `TokenTable.mask` builds its masks: object keys
come only from `properties` (unless `additionalProperties` allows more), each once, and an object
closes only when its required keys are in. Text is read one character at a time (Latin-1 views of
UTF-8 bytes, as json_constraint.py reads tokens); the state is one immutable, hashable tuple, so
masks cache by it.
"""

from __future__ import annotations

from bisect import bisect_left

from kipp_core.json_prefix import _ENDS_NUMBER, _ESCAPES, _HEX, _NUMBER, _PLAIN, _WS, State
from kipp_core.json_schema import (
    ANY_ARR,
    ANY_OBJ,
    Any_,
    Arr,
    Lit,
    Num,
    Obj,
    Str,
    Union,
    first_kind,
)

S = State

# A snapshot is (frames, scalar, done). frames: open containers, innermost last:
#   ("o", Obj, seen keys, phase, key)  phase: "first" after "{", "key" after ",", "colon" after a
#                                      key, "value" after ":", "after" after a value
#   ("a", Arr, items so far, phase)    phase: "first" after "[", "value" after ",", "after"
# scalar: the value or key being read, or None:
#   ("str", key?, text, escape)        a free string (text kept for keys); escape: "", "\\" or
#                                      the hex digits still owed
#   ("lit", cands, lo, hi, typed, key?) one of fixed texts (keys of closed objects too): cands
#                                      sorted, cands[lo:hi] the ones that start with typed
#   ("num", State, integer)

_INITIAL_FRAMES: tuple = ()


def _narrow(cands: tuple, lo: int, hi: int, typed: str) -> tuple[int, int]:
    """The range of the sorted cands[lo:hi] that start with `typed` (empty: lo == hi)."""
    a = bisect_left(cands, typed, lo, hi)
    return a, bisect_left(cands, typed[:-1] + chr(ord(typed[-1]) + 1), a, hi)


def _lit(cands: tuple, typed: str, is_key: bool):
    lo, hi = _narrow(cands, 0, len(cands), typed)
    return ("lit", cands, lo, hi, typed, is_key) if lo < hi else None


def _value_start(node, c: str, frames: tuple):
    """Snapshot parts after c, the first character of a value of `node`; None if it cannot be."""
    if isinstance(node, Union):
        node = dict(node.by_first).get(first_kind(c))
        if node is None:
            return None
    if isinstance(node, Any_):
        node = {"{": ANY_OBJ, "[": ANY_ARR, '"': Str()}.get(c)
        if node is None:
            if c in "-0123456789":
                node = Num(False)
            elif c in "tfn":
                node = Lit(("true", "false", "null"))
            else:
                return None
    if isinstance(node, Obj):
        return (frames + (("o", node, frozenset(), "first", None),), None) if c == "{" else None
    if isinstance(node, Arr):
        return (frames + (("a", node, 0, "first"),), None) if c == "[" else None
    if isinstance(node, Str):
        return (frames, ("str", False, "", "")) if c == '"' else None
    if isinstance(node, Num):
        nxt = _NUMBER[S.MINUS].get(c) if c != "-" else S.MINUS
        return (frames, ("num", nxt, node.integer)) if nxt is not None else None
    if isinstance(node, Lit):
        lit = _lit(node.sorted_texts, c, False)
        return (frames, lit) if lit else None
    return None


def _key_node(obj: Obj, key: str):
    for name, node in obj.props:
        if name == key:
            return node
    return obj.additional


def _after_value(frames: tuple):
    """Frames once the innermost position's value is complete (done: the top level was)."""
    if not frames:
        return frames, True
    top = frames[-1]
    if top[0] == "o":
        kind, obj, seen, _, key = top
        return frames[:-1] + ((kind, obj, seen | {key}, "after", None),), False
    kind, arr, count, _ = top
    return frames[:-1] + ((kind, arr, count + 1, "after"),), False


def _can_add_key(obj: Obj, seen: frozenset) -> bool:
    return obj.additional is not None or any(k not in seen for k, _ in obj.props)


def _key_start(obj: Obj, seen: frozenset):
    if obj.additional is not None:
        return ("str", True, '"', "")
    names = tuple(sorted(k for k, _ in obj.props if k not in seen))
    return _lit(names, '"', True) if names else None


def _structural(frames: tuple, c: str, root):
    """(frames, scalar, done) after c outside any scalar, or None."""
    if not frames:
        start = _value_start(root, c, frames)
        return None if start is None else (*start, False)
    top = frames[-1]
    if top[0] == "o":
        kind, obj, seen, phase, key = top
        if c == "}" and phase in ("first", "after"):
            return _close(frames) if obj.required <= seen else None
        if c == "," and phase == "after":
            if not _can_add_key(obj, seen):
                return None
            return frames[:-1] + ((kind, obj, seen, "key", None),), None, False
        if c == '"' and phase in ("first", "key"):
            start = _key_start(obj, seen)
            return None if start is None else (frames, start, False)
        if c == ":" and phase == "colon":
            return frames[:-1] + ((kind, obj, seen, "value", key),), None, False
        if phase == "value":
            start = _value_start(_key_node(obj, key), c, frames)
            return None if start is None else (*start, False)
        return None
    kind, arr, count, phase = top
    if c == "]" and (phase == "after" or phase == "first"):
        if count < arr.min_items:
            return None
        return _close(frames)
    if c == "," and phase == "after":
        if arr.max_items is not None and count >= arr.max_items:
            return None
        return frames[:-1] + ((kind, arr, count, "value"),), None, False
    if phase == "value" or (phase == "first" and (arr.max_items is None or arr.max_items > 0)):
        start = _value_start(arr.items, c, frames)
        return None if start is None else (*start, False)
    return None


def _close(frames: tuple):
    rest, done = _after_value(frames[:-1])
    return rest, None, done


def _end_key(frames: tuple, key: str):
    kind, obj, seen, _, _ = frames[-1]
    return frames[:-1] + ((kind, obj, seen, "colon", key),)


def _advance(snap, text: str, root):
    frames, scalar, done = snap
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if scalar is not None and scalar[0] == "str":
            _, is_key, typed, esc = scalar
            if not esc:
                run = _PLAIN.match(text, i)
                if run:
                    if is_key:
                        typed += run.group()
                    scalar = ("str", is_key, typed, esc)
                    i = run.end()
                    continue
                if c == '"':
                    i += 1
                    if is_key:
                        frames, scalar = _end_key(frames, typed + '"'), None
                    else:
                        frames, done = _after_value(frames)
                        scalar = None
                    continue
                if c != "\\":
                    return None
                scalar = ("str", is_key, typed + c if is_key else typed, "\\")
            elif esc == "\\":
                if c == "u":
                    esc = "####"
                elif c in _ESCAPES:
                    esc = ""
                else:
                    return None
                scalar = ("str", is_key, typed + c if is_key else typed, esc)
            else:
                if c not in _HEX:
                    return None
                scalar = ("str", is_key, typed + c if is_key else typed, esc[1:])
            i += 1
            continue
        if scalar is not None and scalar[0] == "lit":
            _, cands, lo, hi, typed, is_key = scalar
            a, b = _narrow(cands, lo, hi, typed + c)
            if a < b:
                scalar, i = ("lit", cands, a, b, typed + c, is_key), i + 1
                if b - a == 1 and cands[a] == typed + c:  # nothing longer: the value ends here
                    if is_key:
                        frames, scalar = _end_key(frames, typed + c), None
                    else:
                        frames, done = _after_value(frames)
                        scalar = None
                continue
            if cands[lo] != typed or is_key:  # (the shortest of the range: typed, if whole)
                return None
            frames, done = _after_value(frames)  # a complete literal; c follows it
            scalar = None
            continue
        if scalar is not None:  # a number
            _, state, integer = scalar
            nxt = _NUMBER[state].get(c)
            if nxt is not None and not (integer and c in ".eE"):
                scalar, i = ("num", nxt, integer), i + 1
                continue
            if state not in _ENDS_NUMBER:
                return None
            frames, done = _after_value(frames)
            scalar = None
            continue
        i += 1
        if c in _WS:
            continue  # whitespace between tokens is JSON's to allow (JsonConstraint bounds runs)
        if done:
            return None
        nxt = _structural(frames, c, root)
        if nxt is None:
            return None
        frames, scalar, done = nxt
    return frames, scalar, done


class SchemaPrefix:
    """Accepts text piece by piece while it stays a prefix of a JSON value valid for `root`.
    The interface of json_prefix.JsonPrefix (feed, can_feed, copy, state, is_complete, _snap)."""

    __slots__ = ("root", "_state")

    def __init__(self, root, snap=None) -> None:
        self.root = root
        self._state = (_INITIAL_FRAMES, None, False) if snap is None else snap

    @property
    def _snap(self):
        return (self.root, self._state)  # the mask cache's key: the schema and the state

    def feed(self, text: str) -> bool:
        nxt = _advance(self._state, text, self.root)
        if nxt is None:
            return False
        self._state = nxt
        return True

    def can_feed(self, text: str) -> bool:
        return _advance(self._state, text, self.root) is not None

    def fed(self, text: str) -> SchemaPrefix | None:
        """A new prefix with `text` read, or None if it cannot be (this one is unchanged)."""
        nxt = _advance(self._state, text, self.root)
        return None if nxt is None else SchemaPrefix(self.root, nxt)

    def copy(self) -> SchemaPrefix:
        return SchemaPrefix(self.root, self._state)

    @property
    def at_gap(self) -> bool:
        """Between JSON tokens: whitespace changes nothing here."""
        return self._state[1] is None

    def fixed(self) -> tuple | None:
        """Inside a string that is one of fixed texts (an enum member, a key of a closed object)
        and cannot end yet: (cands, lo, hi, typed), cands[lo:hi] the texts that start with
        typed; else None."""
        scalar = self._state[1]
        if scalar is None or scalar[0] != "lit" or scalar[4][0] != '"':
            return None
        _, cands, lo, hi, typed, _ = scalar
        return None if cands[lo] == typed else (cands, lo, hi, typed)

    def with_fixed(self, lo: int, hi: int, typed: str) -> SchemaPrefix:
        """This prefix further into its fixed texts: typed so far, cands[lo:hi] still possible."""
        frames, scalar, done = self._state
        return SchemaPrefix(self.root, (frames, (*scalar[:2], lo, hi, typed, scalar[5]), done))

    def next_chars(self) -> set[str] | None:
        """The characters that may come next, inside one of fixed texts that cannot end yet;
        else None (not known here)."""
        scalar = self._state[1]
        if scalar is None or scalar[0] != "lit":
            return None
        _, cands, lo, hi, typed, _ = scalar
        if cands[lo] == typed:  # it may end here, and anything may follow a value
            return None
        n, out = len(typed), set()
        while lo < hi:
            c = cands[lo][n]
            out.add(c)
            lo = bisect_left(cands, typed + chr(ord(c) + 1), lo, hi)
        return out

    @property
    def in_string(self) -> bool:
        """Inside a string (a free one, or one of fixed texts): whitespace here is its text."""
        scalar = self._state[1]
        if scalar is None:
            return False
        return scalar[0] == "str" or scalar[0] == "lit" and scalar[4][0] == '"'

    @property
    def is_complete(self) -> bool:
        """The value is whole and closed: only whitespace may follow."""
        return self._state[2]

    @property
    def may_end(self) -> bool:
        """The text so far is a whole value: complete, or a top-level number or literal that may
        also go on ("1" of "12")."""
        frames, scalar, done = self._state
        if done or frames or scalar is None:
            return done
        if scalar[0] == "num":
            return scalar[1] in _ENDS_NUMBER
        return scalar[0] == "lit" and scalar[1][scalar[2]] == scalar[4]

    @property
    def state(self) -> State:
        """What json_constraint.py asks: START before the value, STRING inside a free string
        (whose plain characters need no check), ESCAPE/HEX in its escapes, DONE after."""
        frames, scalar, done = self._state
        if done:
            return S.DONE
        if scalar is None:
            return S.START if not frames else S.AFTER
        if scalar[0] == "str":
            return S.STRING if not scalar[3] else S.ESCAPE if scalar[3] == "\\" else S.HEX
        return S.LITERAL if scalar[0] == "lit" else S.INT
