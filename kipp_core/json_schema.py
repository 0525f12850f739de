"""Incremental check that text is a prefix of a JSON value valid for a JSON schema, for
`response_format: json_schema` and the arguments of forced tool calls.

`compile_schema` turns the subset that structured outputs use into immutable nodes: `type`
(one or a list), `properties` / `required` / `additionalProperties`, `items` / `minItems` /
`maxItems`, `enum` / `const`, `anyOf` / `oneOf`, a one-schema `allOf` and local `$ref`s
("#/$defs/..." or "#/definitions/..."). Alternatives are told apart by their first character
(`{`, `[`, `"`, a digit, `t`/`f`, `n`); two of the same kind merge into that kind unconstrained
(any object, any string, ...). Keywords outside the subset (patterns, lengths, numeric bounds,
formats) are not enforced. `SchemaPrefix` has `JsonPrefix`'s interface, so `TokenTable.mask`
builds its masks: object keys come only from `properties` (unless `additionalProperties` allows
more), each once, and an object closes only when its required keys are in.

Text is read one character at a time (Latin-1 views of UTF-8 bytes, as json_constraint.py reads
tokens); the state is one immutable, hashable tuple, so masks cache by it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kipp_core.json_prefix import _ENDS_NUMBER, _ESCAPES, _HEX, _NUMBER, _PLAIN, _WS, State

S = State


@dataclass(frozen=True)
class Any_:
    """Any JSON value."""


@dataclass(frozen=True)
class Obj:
    props: tuple  # ((name as its JSON text, node), ...)
    required: frozenset  # names as JSON texts
    additional: object | None  # the node of keys outside props, or None: no others allowed


@dataclass(frozen=True)
class Arr:
    items: object
    min_items: int = 0
    max_items: int | None = None


@dataclass(frozen=True)
class Str:
    """A free string."""


@dataclass(frozen=True)
class Num:
    integer: bool


@dataclass(frozen=True)
class Lit:
    """One of these exact JSON texts (booleans, null, enum and const values)."""

    texts: tuple


@dataclass(frozen=True)
class Union:
    by_first: tuple  # ((kind, node), ...), kind one of "{", "[", '"', "0", "t", "n"


ANY = Any_()
ANY_OBJ = Obj((), frozenset(), ANY)
ANY_ARR = Arr(ANY)


def _text(value) -> str:
    # a value's JSON text as the byte view the tokens are read in
    return json.dumps(value, ensure_ascii=False).encode().decode("latin-1")


def _kind(node) -> list[str]:
    """The first-character kinds a node's values start with."""
    if isinstance(node, Obj):
        return ["{"]
    if isinstance(node, Arr):
        return ["["]
    if isinstance(node, Str):
        return ['"']
    if isinstance(node, Num):
        return ["0"]
    if isinstance(node, Lit):
        return sorted({_first_kind(t) for t in node.texts})
    if isinstance(node, Union):
        return [k for k, _ in node.by_first]
    return ["{", "[", '"', "0", "t", "n"]


def _first_kind(text: str) -> str:
    c = text[0]
    return "0" if c in "-0123456789" else "t" if c == "f" else c


_WIDE = {"{": ANY_OBJ, "[": ANY_ARR, '"': Str(), "0": Num(False), "t": Lit(("true", "false"))}


def _union(nodes: list):
    by: dict[str, object] = {}
    for node in nodes:
        if isinstance(node, Any_):
            return ANY
        for k in _kind(node):
            part = node
            if isinstance(node, Union):
                part = dict(node.by_first)[k]
            elif isinstance(node, Lit):
                part = Lit(tuple(t for t in node.texts if _first_kind(t) == k))
            if k not in by:
                by[k] = part
            elif by[k] != part:
                a, b = by[k], part
                if isinstance(a, Lit) and isinstance(b, Lit):
                    by[k] = Lit(tuple(dict.fromkeys(a.texts + b.texts)))
                elif isinstance(a, Num) and isinstance(b, Num):
                    by[k] = Num(a.integer and b.integer)
                else:
                    by[k] = _WIDE.get(k, Lit(("null",)))
    if len(by) == 1:
        return next(iter(by.values()))
    return Union(tuple(sorted(by.items())))


MAX_NODES = 10_000  # a schema whose $refs expand past this many nodes is refused


def compile_schema(schema, root=None, depth: int = 0, budget: list | None = None):
    """The node of a JSON schema (a dict, or True/False). ValueError names what is wrong."""
    root = schema if root is None else root
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"schema expands to more than {MAX_NODES} nodes")
    if depth > 64:
        raise ValueError("schema nests (or refers to itself) more than 64 levels deep")
    if schema is True or schema == {}:
        return ANY
    if not isinstance(schema, dict):
        raise ValueError(f"a schema must be an object or a boolean, got {schema!r:.60}")
    if "$ref" in schema:
        return compile_schema(_resolve(schema["$ref"], root), root, depth + 1, budget)
    if "const" in schema:
        return Lit((_text(schema["const"]),))
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError("enum must be a non-empty list")
        return Lit(tuple(dict.fromkeys(_text(v) for v in values)))
    if "allOf" in schema:  # pydantic's [{"$ref": ...}] around a field with a description
        parts = schema["allOf"]
        if not isinstance(parts, list) or len(parts) != 1:
            raise ValueError("allOf is supported with exactly one schema")
        rest = {k: v for k, v in schema.items() if k != "allOf"}
        return compile_schema({**rest, **parts[0]}, root, depth + 1, budget)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            alts = schema[key]
            if not isinstance(alts, list) or not alts:
                raise ValueError(f"{key} must be a non-empty list")
            return _union([compile_schema(a, root, depth + 1, budget) for a in alts])
    kind = schema.get("type")
    if isinstance(kind, list):
        if not kind:
            raise ValueError("type must not be an empty list")
        return _union(
            [compile_schema({**schema, "type": k}, root, depth + 1, budget) for k in kind]
        )
    if kind is None:
        if "properties" in schema:
            kind = "object"
        elif "items" in schema:
            kind = "array"
        else:
            return ANY
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError("properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("required must be a list of strings")
        missing = [r for r in required if r not in props]
        extra = schema.get("additionalProperties", True)
        if missing and extra is False:
            raise ValueError(f"required names {missing[0]!r}, which properties lacks")
        nodes = tuple(
            (_text(k), compile_schema(v, root, depth + 1, budget)) for k, v in props.items()
        )
        additional = None if extra is False else compile_schema(extra, root, depth + 1, budget)
        return Obj(nodes, frozenset(_text(r) for r in required), additional)
    if kind == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(lo, int) or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            raise ValueError("minItems and maxItems must be integers with minItems <= maxItems")
        return Arr(compile_schema(schema.get("items", True), root, depth + 1, budget), lo, hi)
    if kind == "string":
        return Str()
    if kind in ("integer", "number"):
        return Num(kind == "integer")
    if kind == "boolean":
        return Lit(("true", "false"))
    if kind == "null":
        return Lit(("null",))
    raise ValueError(f"unknown type {kind!r}")


def _resolve(ref, root):
    m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
    defs = root.get(m.group(1)) if m else None
    if not isinstance(defs, dict) or m.group(2) not in defs:
        raise ValueError(f"$ref {ref!r} is not a local #/$defs/NAME or #/definitions/NAME")
    return defs[m.group(2)]


# -- the automaton ------------------------------------------------------------------------------
# A snapshot is (frames, scalar, done). frames: open containers, innermost last:
#   ("o", Obj, seen keys, phase, key)  phase: "first" after "{", "key" after ",", "colon" after a
#                                      key, "value" after ":", "after" after a value
#   ("a", Arr, items so far, phase)    phase: "first" after "[", "value" after ",", "after"
# scalar: the value or key being read, or None:
#   ("str", key?, text, escape)        a free string (text kept for keys); escape: "", "\\" or
#                                      the hex digits still owed
#   ("lit", candidates, typed, key?)   one of fixed texts (keys of closed objects too)
#   ("num", State, integer)

_INITIAL_FRAMES: tuple = ()


def _value_start(node, c: str, frames: tuple):
    """Snapshot parts after c, the first character of a value of `node`; None if it cannot be."""
    if isinstance(node, Union):
        node = dict(node.by_first).get(_first_kind(c))
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
        live = tuple(t for t in node.texts if t.startswith(c))
        return (frames, ("lit", live, c, False)) if live else None
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
    names = tuple(k for k, _ in obj.props if k not in seen)
    return ("lit", names, '"', True) if names else None


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
            _, live, typed, is_key = scalar
            ext = tuple(t for t in live if t.startswith(typed + c))
            if ext:
                scalar, i = ("lit", ext, typed + c, is_key), i + 1
                if typed + c in ext and len(ext) == 1:  # nothing longer: the value ends here
                    if is_key:
                        frames, scalar = _end_key(frames, typed + c), None
                    else:
                        frames, done = _after_value(frames)
                        scalar = None
                continue
            if typed not in live or is_key:
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

    def copy(self) -> SchemaPrefix:
        return SchemaPrefix(self.root, self._state)

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
        return scalar[0] == "lit" and scalar[2] in scalar[1]

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
