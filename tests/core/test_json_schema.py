"""json_schema's automaton against the `jsonschema` package (the outside validator): a document
fed whole or one character at a time is accepted and may end exactly when jsonschema validates
it; every prefix of a valid document stays accepted; and schemas outside the subset fail with a
ValueError that says why."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kipp_core.json_schema import ANY, Obj, compile_schema
from kipp_core.schema_prefix import SchemaPrefix

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 2},
        "height": {"type": ["number", "null"]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "$defs": {
        "pt": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["x"],
        }
    },
    "type": "object",
    "properties": {"pts": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1}},
    "required": ["pts"],
}
EITHER = {"anyOf": [{"type": "integer"}, {"type": "string"}, {"const": {"k": True}}]}
SCHEMAS = [PERSON, NESTED, EITHER, {"type": "boolean"}, {"enum": [1, 10, "x"]}, {}]

DOCS = [
    '{"name": "Ann", "age": 31}',
    '{"age": 31, "name": "Ann", "tags": ["a", 3], "height": null}',
    '{"name": "Ann", "age": 31, "tags": ["a", "b", null]}',
    '{"name": "Ann", "age": 31.5}',
    '{"name": "Ann"}',
    '{"name": "Ann", "age": 3, "eyes": "blue"}',
    '{"name": "\\u00e9\\n", "age": -0, "height": 1.5e3}',
    '{"name": "Ann", "age": 3, "tags": ["c"]}',
    '{"pts": [{"x": 1, "ok": true}, {"x": -2.5, "extra": [1, {}]}]}',
    '{"pts": []}',
    '{"pts": [{"ok": false}]}',
    '{"pts": [{"x": "1"}]}',
    "17",
    '"seventeen"',
    '{"k": true}',
    '{"k": 1}',
    "true",
    "false",
    "null",
    "1",
    "10",
    "100",
    '"x"',
    '"y"',
    "[]",
    '{"any": [1, "two", {"three": null}]}',
]


def _valid(schema, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (jsonschema.ValidationError, json.JSONDecodeError):
        return False
    return True


def _accepts(node, text: str, whole: bool) -> bool:
    p = SchemaPrefix(node)
    pieces = [text] if whole else list(text)
    return all(p.feed(s) for s in pieces) and p.may_end


@pytest.mark.parametrize(
    "schema", SCHEMAS, ids=["person", "nested", "either", "bool", "enum", "any"]
)
def test_accepts_exactly_what_jsonschema_validates(schema):
    node = compile_schema(schema)
    for text in DOCS:
        want = _valid(schema, text)
        assert _accepts(node, text, whole=True) == want, text
        assert _accepts(node, text, whole=False) == want, text
        if want:  # every prefix of a valid document can still be completed
            p = SchemaPrefix(node)
            for k, c in enumerate(text):
                assert p.feed(c), (text, k)
    assert sum(_valid(schema, t) for t in DOCS) > 0  # each schema meets valid documents


def test_an_object_closes_only_with_its_required_keys_and_no_key_twice():
    p = SchemaPrefix(compile_schema(PERSON))
    assert p.feed('{"name": "A"')
    assert not p.can_feed("}")  # age is required
    assert not p.can_feed(', "name"')  # no key twice
    assert not p.can_feed(', "nam ')  # keys come from properties
    assert p.feed(', "age": 4') and p.can_feed("}")
    assert p.feed("}") and p.is_complete and not p.can_feed(",")


def test_integers_take_no_fraction_and_arrays_keep_their_bounds():
    p = SchemaPrefix(compile_schema(PERSON))
    assert p.feed('{"name": "A", "age": 4')
    assert not p.can_feed(".") and not p.can_feed("e") and p.can_feed("2")
    assert p.feed(', "tags": ["a", 3')
    assert not p.can_feed(",") and p.can_feed("]")  # maxItems 2
    q = SchemaPrefix(compile_schema(NESTED))
    assert q.feed('{"pts": [') and not q.can_feed("]")  # minItems 1


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"$ref": "http://x/y"}, "local"),
        ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a'"),
        ({"type": "tuple"}, "unknown type"),
        ({"enum": []}, "enum"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "64 levels"),
        ([1], "object or a boolean"),
        ({"type": []}, "empty"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        (  # a DAG of refs that doubles at each of 20 levels
            {
                "$defs": {
                    f"d{i}": {
                        "type": "array",
                        "items": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2},
                    }
                    for i in range(20)
                }
                | {"d20": {"type": "integer"}},
                "$ref": "#/$defs/d0",
            },
            "nodes",
        ),
        ({"enum": ["x" * 60] * 2100}, "too large"),  # members count with their length
        ({"properties": {f"{i:08}": {} for i in range(12000)}}, "too large"),  # and names
    ],
)
def test_bad_schemas_say_why(schema, message):
    with pytest.raises(ValueError, match=message):
        compile_schema(schema)


def test_a_one_schema_allof_is_that_schema():
    """pydantic wraps a described $ref field as allOf: [{"$ref": ...}]."""
    schema = {
        "$defs": {"U": {"enum": ["C", "F"]}},
        "type": "object",
        "properties": {"unit": {"allOf": [{"$ref": "#/$defs/U"}], "description": "the unit"}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    node = compile_schema(schema)
    for text in ('{"unit": "C"}', '{"unit": "K"}', '{"unit": 1}'):
        assert _accepts(node, text, whole=True) == _valid(schema, text), text


def test_what_compiles_to_what():
    assert compile_schema({}) is ANY and compile_schema(True) is ANY
    obj = compile_schema({"properties": {"a": {}}})  # no type, but properties: an object
    assert isinstance(obj, Obj) and obj.props == (('"a"', ANY),) and obj.additional is ANY


def test_pydantic_schemas_compile_and_agree_with_jsonschema():
    """Schemas as pydantic writes them ($defs, $ref, allOf, anyOf with null, enums, titles and
    defaults), the usual source of response_format schemas."""
    import enum
    from typing import Literal

    import pydantic

    class Unit(str, enum.Enum):
        c = "C"
        f = "F"

    class Place(pydantic.BaseModel):
        city: str
        country: str | None = None

    class Forecast(pydantic.BaseModel):
        place: Place = pydantic.Field(description="where")
        unit: Unit = Unit.c
        days: list[int] = pydantic.Field(max_length=3)
        kind: Literal["daily", "hourly"]

    schema = Forecast.model_json_schema()
    node = compile_schema(schema)
    docs = [
        '{"place": {"city": "Oslo"}, "days": [1, 2], "kind": "daily"}',
        '{"place": {"city": "Oslo", "country": null}, "unit": "F", "days": [], "kind": "hourly"}',
        '{"place": {"city": "Oslo"}, "days": [1, 2, 3, 4], "kind": "daily"}',
        '{"place": {"city": "Oslo"}, "unit": "K", "days": [1], "kind": "daily"}',
        '{"place": {"country": "NO"}, "days": [1], "kind": "daily"}',
        '{"place": {"city": "Oslo"}, "days": [1.5], "kind": "daily"}',
        '{"place": {"city": "Oslo"}, "days": [1], "kind": "weekly"}',
    ]
    for text in docs:
        assert _accepts(node, text, whole=False) == _valid(schema, text), text
    assert sum(_valid(schema, t) for t in docs) == 2
