"""normalize and lint: what is refused, and how (a 400 naming the path and the construct), and the
bounds that keep hostile schemas from blowing up."""
from __future__ import annotations

import json

import pytest

from radixflow.services.grammar.lint import check_schema, prepare
from radixflow.services.grammar.normalize import MAX_DEPTH, normalize
from radixflow.shared.errors import BadRequest

S = {"type": "string", "maxLength": 12}


# ---------------------------------------------------------------- refusals and bounds


@pytest.mark.parametrize("schema,message", [
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, r"at \$: the allowed types"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 3}]}},
      "required": ["a"]}, r"at \$: required property 'a': \$\.properties\.a: no number"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"allOf": [{"enum": [1, 2]}, {"const": 3}]}}, "required": ["b"]}}, "required": ["a"]},
     r"\$\.properties\.a\.properties\.b: no value of the enum/const"),
    ({"type": "string", "minLength": 4, "allOf": [{"maxLength": 2}]}, "minLength 4 > maxLength 2"),
    ({"type": "object", "properties": {"a": S}, "required": ["b"], "additionalProperties": False},
     "required property 'b' is not allowed"),
    ({"anyOf": [{"type": "string", "enum": [1]}, {"type": "integer", "minimum": 2, "maximum": 1}]},
     r"no branch of anyOf can be satisfied"),
])
def test_unsatisfiable_is_400_naming_the_path(schema, message):
    with pytest.raises(BadRequest, match=message) as ei:
        check_schema(schema)
    assert ei.value.code == 400 and "the JSON Schema is unsatisfiable at $" in ei.value.message


def test_deep_nesting_is_400_not_a_crash():
    deep: dict = {"type": "integer"}
    for _ in range(1000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(BadRequest, match="nested too deeply"):
        check_schema(deep)
    with pytest.raises(BadRequest, match="nested too deeply"):
        normalize(deep)
    ok: dict = {"type": "integer"}
    for _ in range(MAX_DEPTH // 2):
        ok = {"properties": {"a": ok}}
    assert normalize(ok)["type"] == "object"


def test_conditional_blowup_is_bounded():
    # 12 if/then/else on one object: left for the output check rather than 4096 branches
    props = {f"p{i}": {"enum": ["x", "y"]} for i in range(12)}
    schema = {"type": "object", "properties": props, "required": list(props), "allOf": [
        {"if": {"properties": {f"p{i}": {"const": "x"}}}, "then": {"properties": {f"p{(i + 1) % 12}": {"const": "y"}}}}
        for i in range(12)]}
    out, level = prepare(schema)
    assert level == "checked" and "anyOf" not in json.dumps(out)


@pytest.mark.parametrize("schema,construct", [
    ({"type": "object", "properties": {"p": {"$ref": "https://example.com/p.json"}}}, "'$ref' at $.properties.p"),
    ({"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$dynamicRef": "#n"}}}, "'$dynamicRef'"),
    ({"type": "object", "properties": {"a": {"$ref": "https://x/b.json"}},
      "$defs": {"a": {"$id": "https://x/a.json", "type": "string"}}}, "'$ref' at $.properties.a"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
])
def test_unservable_references_are_400(schema, construct):
    with pytest.raises(BadRequest, match=construct.replace("$", r"\$").replace(".", r"\.")):
        prepare(schema)


def test_a_value_that_is_not_a_schema_is_400_naming_it():
    """Under a keyword no metaschema looks into, reached by a $ref (pymisp keeps its definitions
    under `defs`): a property whose "schema" is a list is a 400 naming the path, not a crash."""
    schema = {"type": "object", "properties": {"g": {"$ref": "#/defs/group"}},
              "defs": {"group": {"type": "object", "properties": {"uuid": {"type": "string"}, "required": ["uuid"]}}}}
    with pytest.raises(BadRequest, match=r"list \['uuid'\] at \$\.defs\.group\.properties\.required"):
        prepare(schema)
