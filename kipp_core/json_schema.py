"""JSON schemas compiled for constrained decoding (`response_format: json_schema` and the
arguments of forced tool calls).

`compile_schema` turns the subset that structured outputs use into immutable nodes: `type`
(one or a list), `properties` / `required` / `additionalProperties`, `items` / `minItems` /
`maxItems`, `enum` / `const`, `anyOf` / `oneOf`, a one-schema `allOf` and local `$ref`s
("#/$defs/..." or "#/definitions/..."). Alternatives are told apart by their first character
(`{`, `[`, `"`, a digit, `t`/`f`, `n`); two of the same kind merge into that kind unconstrained
(any object, any string, ...). Keywords outside the subset (patterns, lengths, numeric bounds,
formats) are not enforced. Nodes are frozen dataclasses, equal when their schemas are, so token
masks cache across requests by them; schema_prefix.py reads text against them.

Compiling is bounded: every node costs 1 and every fixed text (an enum or const value, a property
name) 1 plus its length, and a schema over MAX_SCHEMA_SIZE is refused, so what a request can make
the mask computation walk (json_constraint.py) stays bounded too.
"""

from __future__ import annotations

import functools
import json
import json.encoder
import re
from dataclasses import dataclass


def _node(cls):
    """A frozen dataclass whose hash is computed once (a mask cache key holds whole schemas);
    the cached value is not pickled (string hashes differ between processes)."""
    cls = dataclass(frozen=True)(cls)
    plain = cls.__hash__

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = plain(self)
        return h

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    cls.__hash__, cls.__getstate__ = __hash__, __getstate__
    return cls


class Texts(tuple):
    """A tuple of texts whose hash is computed once (held in mask cache keys)."""

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h

    def __reduce__(self):
        return Texts, (tuple(self),)


@_node
class Any_:
    """Any JSON value."""


@_node
class Obj:
    props: tuple  # ((name as its JSON text, node), ...)
    required: frozenset  # names as JSON texts
    additional: object | None  # the node of keys outside props, or None: no others allowed


@_node
class Arr:
    items: object
    min_items: int = 0
    max_items: int | None = None


@_node
class Str:
    """A free string."""


@_node
class Num:
    integer: bool


@_node
class Lit:
    """One of these exact JSON texts (booleans, null, enum and const values)."""

    texts: tuple

    @functools.cached_property
    def sorted_texts(self) -> tuple:
        """The texts in order: those sharing a prefix are one range (schema_prefix bisects)."""
        return Texts(sorted(self.texts))


@_node
class Union:
    by_first: tuple  # ((kind, node), ...), kind one of "{", "[", '"', "0", "t", "n"


ANY = Any_()
ANY_OBJ = Obj((), frozenset(), ANY)
ANY_ARR = Arr(ANY)


def _text(value) -> str:
    # a value's JSON text as the byte view the tokens are read in
    text = _quote(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text.encode().decode("latin-1")


_quote = json.encoder.encode_basestring  # json.dumps of a str, without its dispatch


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
        return sorted({first_kind(t) for t in node.texts})
    if isinstance(node, Union):
        return [k for k, _ in node.by_first]
    return ["{", "[", '"', "0", "t", "n"]


def first_kind(text: str) -> str:
    """The kind a JSON text starts: "{", "[", '"', "0" (a number), "t" (a boolean) or "n"."""
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
                part = Lit(tuple(t for t in node.texts if first_kind(t) == k))
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


# Nodes plus the characters of fixed texts (2^17): a 9,000-member enum of 9-letter names
# (108,000) fits; compiling it took ~50 ms and its costliest mask ~15 ms on a shared 2-core host.
MAX_SCHEMA_SIZE = 131_072


def _spend(budget: list, cost: int) -> None:
    budget[0] -= cost
    if budget[0] < 0:
        raise ValueError(
            f"schema is too large: it expands to more than {MAX_SCHEMA_SIZE} nodes and "
            "characters of enum, const and property names"
        )


def _texts(values, budget: list) -> tuple:
    out = []
    for v in values:
        t = _text(v)
        _spend(budget, 1 + len(t))
        out.append(t)
    return tuple(dict.fromkeys(out))


def compile_schema(schema, root=None, depth: int = 0, budget: list | None = None):
    """The node of a JSON schema (a dict, or True/False). ValueError names what is wrong."""
    root = schema if root is None else root
    budget = [MAX_SCHEMA_SIZE] if budget is None else budget
    _spend(budget, 1)
    if depth > 64:
        raise ValueError("schema nests (or refers to itself) more than 64 levels deep")
    if schema is True or schema == {}:
        return ANY
    if not isinstance(schema, dict):
        raise ValueError(f"a schema must be an object or a boolean, got {schema!r:.60}")
    if "$ref" in schema:
        return compile_schema(_resolve(schema["$ref"], root), root, depth + 1, budget)
    if "const" in schema:
        return Lit(_texts([schema["const"]], budget))
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError("enum must be a non-empty list")
        return Lit(_texts(values, budget))
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
        names = _texts(props, budget)
        nodes = tuple(
            (name, compile_schema(v, root, depth + 1, budget))
            for name, v in zip(names, props.values())
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
