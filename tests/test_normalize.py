"""normalize (schema rewrites that keep the meaning) and lint.prepare (what the grammar compiles,
and whether the output must be checked): validity sets compared on sampled instances, and the
acceptance check's schemas compiled through the Compiler (refusals and bounds:
test_normalize_refusals.py)."""
from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from radixflow.services.grammar.normalize import normalize

S = {"type": "string", "maxLength": 12}


def validator(schema: Any) -> Draft202012Validator:
    return Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)


# ---------------------------------------------------------------- instances


def _pool(schema: Any) -> tuple[list[str], list[Any]]:
    """Property names and scalar values the schema talks about, each bound and its neighbours."""
    names: list[str] = ["zz"]
    values: list[Any] = [None, True, False, 0, 1, -1, 2.5, -0.5, "", "a", "abc", "AAA", "ZZZ", [], {}]
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for k, v in node.items():
            if k in ("enum", "examples"):
                values.extend(v)
            elif k == "const":
                values.append(v)
            elif k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
                values.extend([v, v - 1, v + 1, v - 0.5, v + 0.5, 2 * v])
            elif k in ("minLength", "maxLength"):
                values.extend(["x" * n for n in (v - 1, v, v + 1) if n >= 0])
            elif k in ("properties", "patternProperties", "dependentRequired", "dependentSchemas"):
                names.extend(node[k])
            elif k == "required":
                names.extend(v)
            if k not in ("enum", "const", "examples"):
                stack.append(v)
    return sorted(set(names)), values


def instances(schema: Any, n: int = 400, seed: int = 0, near: list | None = None) -> list[Any]:
    """Random JSON values built from what the schema names, half of them (when given) one change
    away from an instance in `near`."""
    names, values = _pool(schema)
    rng = random.Random(seed)

    def one(depth: int) -> Any:
        r = rng.random()
        if depth >= 3 or r < 0.35:
            return copy.deepcopy(rng.choice(values))
        if r < 0.85:
            keys = rng.sample(names, rng.randint(0, min(len(names), 4)))
            return {k: one(depth + 1) for k in keys}
        return [one(depth + 1) for _ in range(rng.randint(0, 4))]

    def mutant(x: Any) -> Any:
        x = copy.deepcopy(x)
        if isinstance(x, dict) and x and rng.random() < 0.8:
            k = rng.choice(list(x))
            r = rng.random()
            if r < 0.3:
                del x[k]
            elif r < 0.5:
                x[rng.choice(names)] = one(2)
            else:
                x[k] = mutant(x[k])
            return x
        if isinstance(x, list) and x and rng.random() < 0.8:
            i = rng.randrange(len(x))
            x[i] = mutant(x[i]) if rng.random() < 0.7 else one(2)
            return x
        if isinstance(x, str) and rng.random() < 0.8:
            i = rng.randint(0, len(x))
            return x[:i] + rng.choice(["", "a", "b", "x", "Z", "0"]) + x[i + rng.randint(0, 1):]
        if isinstance(x, (int, float)) and not isinstance(x, bool) and rng.random() < 0.8:
            return x + rng.choice([-1, 1, 0.5])
        return one(2)

    out = [one(0) if i % 4 else {k: one(1) for k in names if rng.random() < 0.7} for i in range(n)]
    if near:
        out[::2] = [mutant(rng.choice(near)) for _ in out[::2]]
    return out


def assert_same_meaning(original: dict, normalized: dict, valid: list, invalid: list, narrows: bool = False) -> None:
    vo, vn = validator(original), validator(normalized)
    for x in valid:
        assert vo.is_valid(x), f"test bug: {x!r} should be valid under the original"
        assert vn.is_valid(x), f"{x!r} is valid but the normalized schema refuses it: {normalized}"
    for x in invalid:
        assert not vo.is_valid(x), f"test bug: {x!r} should be invalid under the original"
        assert not vn.is_valid(x), f"{x!r} is invalid but the normalized schema accepts it: {normalized}"
    sampled = instances(original, near=valid + invalid) + instances(normalized, seed=1, near=valid)
    agree = [x for x in sampled if vo.is_valid(x) == vn.is_valid(x)]
    widened = [x for x in sampled if vn.is_valid(x) and not vo.is_valid(x)]
    assert not widened, f"accepted by the normalized schema only: {widened[0]!r}\n{normalized}"
    if not narrows:
        assert len(agree) == len(sampled), f"{[x for x in sampled if x not in agree][0]!r}\n{normalized}"
    assert any(vo.is_valid(x) for x in sampled), "the sampler never met a valid instance: add some by hand"


def keywords(schema: Any) -> set[str]:
    """Every keyword used anywhere in a schema (property names included, which is harmless here)."""
    out, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            out |= set(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


# ---------------------------------------------------------------- the rules, exact


UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "t": {"type": "integer"}},
        "required": ["unit", "t"], "additionalProperties": False,
        "if": {"properties": {"unit": {"const": "c"}}},
        "then": {"properties": {"t": {"minimum": -50, "maximum": 60}}},
        "else": {"properties": {"t": {"minimum": -60, "maximum": 140}}}}

EXACT = [
    # name, schema, valid, invalid
    ("annotations_and_extensions",
     {"type": "object", "title": "T", "description": "d", "x-taplo": {"hidden": True}, "examples": [{"v": 1}],
      "$comment": "c", "properties": {"v": {"type": "integer", "x-order": 1, "default": 3, "deprecated": True,
                                            "readOnly": True, "writeOnly": False, "minimum": 0, "maximum": 9}},
      "required": ["v"], "additionalProperties": False},
     [{"v": 3}], [{"v": 10}, {}, {"v": 1, "w": 2}]),
    ("ref_with_siblings",
     {"type": "object", "properties": {"p": {"$ref": "#/$defs/n", "maximum": 5, "description": "x"}}, "required": ["p"],
      "$defs": {"n": {"type": "integer", "minimum": 0}}},
     [{"p": 0}, {"p": 5}], [{"p": 6}, {"p": -1}, {"p": "a"}]),
    ("ref_outside_defs", {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2},
                                                           "b": {"$ref": "#/properties/a"}}},
     [{"a": "xy", "b": "z"}], [{"b": "xyz"}, {"b": 1}]),
    ("anchor_ref", {"$defs": {"p": {"$anchor": "pt", "type": "integer", "maximum": 3}}, "type": "object",
                    "properties": {"p": {"$ref": "#pt"}}, "required": ["p"]},
     [{"p": 3}], [{"p": 4}, {}]),
    ("allOf_two", {"allOf": [{"type": "object", "properties": {"a": S}, "required": ["a"]},
                             {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     [{"a": "x", "b": 1}, {"a": "x", "b": 1, "c": None}], [{"a": "x"}, {"b": 1}, {"a": 1, "b": 1}, 3]),
    ("allOf_closed_part", {"allOf": [{"type": "object", "properties": {"a": S}, "additionalProperties": False},
                                     {"properties": {"b": {"type": "integer"}}}]},
     [{"a": "x"}, {}], [{"a": "x", "b": 1}, {"c": 1}]),
    ("allOf_bounds_types_enums", {"allOf": [{"type": ["number", "string"], "minimum": 1, "enum": [1, 2, 3, "a", 4.5]},
                                            {"type": "integer", "maximum": 3}, {"enum": [3, 2, "a", 1.0]}]},
     [1, 2, 3, 1.0], [4.5, "a", 0, 5]),
    ("allOf_two_bounds_each", {"type": "integer", "allOf": [{"minimum": 1, "maximum": 9, "not": {"const": 4}},
                                                            {"minimum": 3, "maximum": 7, "not": {"const": 5}}]},
     [3, 6, 7], [2, 4, 5, 8]),
    ("allOf_patterns_kept", {"type": "string", "allOf": [{"pattern": "^a"}, {"pattern": "b$"}], "maxLength": 5},
     ["ab", "axb"], ["ba", "a", "abbbbb"]),
    ("allOf_items", {"allOf": [{"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
                               {"prefixItems": [{"minimum": 0}, {"maxLength": 1}], "maxItems": 3}]},
     [[1], [1, "a"], [1, "a", "bc"]], [[-1], [1, "ab"], [1, 2], [1, "a", "b", "c"]]),
    ("allOf_unevaluated", {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}],
                           "properties": {"b": S}, "unevaluatedProperties": False},
     [{"a": 1, "b": "x"}, {}], [{"c": 1}, {"a": "x"}]),
    ("beside_oneOf", {"type": "object", "description": "a shape", "oneOf": [
        {"properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 9}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["kind", "side"], "additionalProperties": False}]},
     [{"kind": "circle", "r": 2.5}, {"kind": "square", "side": 3}], [{"kind": "circle", "side": 3}, {"kind": "x"}, 1]),
    ("oneOf_overlapping", {"type": "integer", "oneOf": [{"minimum": 5}, {"maximum": 7}]},
     [4, 8], [6, 5, 7, "a"]),
    ("oneOf_objects_overlapping", {"type": "object", "oneOf": [
        {"properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]},
        {"properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}]},
     [{"k": "a"}, {"k": "c"}], [{"k": "b"}, {}]),
    ("anyOf_siblings", {"type": "object", "properties": {"a": S}, "required": ["a"],
                        "anyOf": [{"required": ["b"]}, {"properties": {"a": {"maxLength": 1}}}]},
     [{"a": "x"}, {"a": "xyz", "b": 0}], [{"a": "xyz"}, {}]),
    ("if_then_else_enum", UNIT,
     [{"unit": "c", "t": 60}, {"unit": "f", "t": 140}], [{"unit": "c", "t": 61}, {"unit": "f", "t": -61}, {"unit": "k", "t": 0}]),
    ("if_required_in_if", {"type": "object", "properties": {"mode": {"type": "string"}, "n": {"type": "integer"}},
                           "if": {"properties": {"mode": {"const": "fast"}}, "required": ["mode"]},
                           "then": {"properties": {"n": {"maximum": 3}}}, "else": {"properties": {"n": {"minimum": 10}}}},
     [{"mode": "fast", "n": 1}, {"n": 12}, {"mode": "slow", "n": 10}], [{"mode": "fast", "n": 5}, {"n": 1}, {"mode": "slow", "n": 2}]),
    ("if_not_rewritable", {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}},
     [3, 10, 12], [11, 13]),
    ("allOf_four_conditionals", {
        "type": "object", "properties": {f"p{i}": {"enum": ["a", "b", "c"]} for i in range(4)},
        "required": [f"p{i}" for i in range(4)], "additionalProperties": False,
        "allOf": [{"if": {"properties": {f"p{i}": {"const": "a"}}},
                   "then": {"properties": {f"p{(i + 1) % 4}": {"not": {"const": "a"}}}}} for i in range(4)]},
     [{"p0": "a", "p1": "b", "p2": "a", "p3": "c"}, {"p0": "c", "p1": "c", "p2": "c", "p3": "c"}],
     [{"p0": "a", "p1": "a", "p2": "b", "p3": "b"}, {"p0": "a", "p1": "b", "p2": "b", "p3": "a"}]),
    ("dependentRequired", {"type": "object", "properties": {"a": S, "b": S}, "dependentRequired": {"a": ["b"]},
                           "additionalProperties": False},
     [{}, {"b": "x"}, {"a": "x", "b": "y"}], [{"a": "x"}]),
    ("dependentSchemas", {"type": "object", "properties": {"card": S, "billing": {"type": "integer"}},
                          "dependentSchemas": {"card": {"required": ["billing"], "properties": {"billing": {"minimum": 1}}}}},
     [{}, {"card": "x", "billing": 2}], [{"card": "x"}, {"card": "x", "billing": 0}]),
    ("enum_filtered", {"type": "string", "enum": ["ok", 7, "toolong"], "maxLength": 3},
     ["ok"], [7, "toolong"]),
    ("not_beside_enum", {"enum": ["a", "b", "c"], "not": {"enum": ["b"]}}, ["a", "c"], ["b"]),
    ("integer_bounds", {"type": "integer", "minimum": 0.5, "exclusiveMaximum": 4.5}, [1, 4], [0, 5, 1.5]),
    ("required_undeclared", {"type": "object", "properties": {"a": S}, "required": ["a", "b"],
                             "additionalProperties": {"type": "integer"}},
     [{"a": "x", "b": 1}], [{"a": "x"}, {"a": "x", "b": "y"}]),
    ("optional_unsatisfiable", {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]},
                                                                 "b": S}},
     [{"b": "x"}, {}], [{"a": 1}, {"a": "x"}]),
    ("bounds_conflict_drops_type", {"type": ["string", "null"], "minLength": 3, "maxLength": 2}, [None], ["abc", ""]),
    ("enum_only_branches_join", {"type": "object", "properties": {
        "tool": {"pattern": "^[a-z]+@2$", "anyOf": [{"enum": ["ps@2", "ps@1"], "description": "d"}, {"const": "sh@2"},
                                                   {"enum": [1, "cmd@2"]}]},
        "one": {"oneOf": [{"enum": ["a", "b"]}, {"const": "b"}, {"enum": ["c"], "title": "t"}]}}},
     [{"tool": "ps@2"}, {"tool": "sh@2"}, {"tool": 1}, {"one": "a"}, {"one": "c"}],
     [{"tool": "ps@1"}, {"tool": "x@2"}, {"one": "b"}, {"one": "d"}]),
    # not {required: [p]}: p absent; a oneOf whose branches each require what the other forbids is
    # disjoint (AsyncAPI's AMQP channel: routingKey and an exchange, or queue and a queue, never both)
    ("not_required_is_absent", {"type": "object", "properties": {"a": S, "b": S}, "not": {"required": ["b"]}},
     [{"a": "x"}, {}], [{"b": "x"}, {"a": "x", "b": "y"}]),
    ("oneOf_required_and_forbidden", {"type": "object", "properties": {"ex": S, "q": S}, "oneOf": [
        {"required": ["ex"], "not": {"required": ["q"]}}, {"required": ["q"], "not": {"required": ["ex"]}}]},
     [{"ex": "a"}, {"q": "b"}], [{"ex": "a", "q": "b"}, {}]),
    ("recursive_ref_with_sibling", {"type": "object", "properties": {"v": {"type": "integer"},
                                                                     "next": {"$ref": "#", "maxProperties": 1}}},
     [{"v": 1, "next": {"next": {"v": 2}}}], [{"v": 1, "next": {"v": 1, "next": {}}}, {"next": {"next": {"v": "x"}}}]),
]


BY_NAME = {c[0]: c[1] for c in EXACT}


@pytest.mark.parametrize("name,schema,valid,invalid", EXACT, ids=[c[0] for c in EXACT])
def test_rule_keeps_the_meaning(name, schema, valid, invalid):
    out = normalize(schema)
    Draft202012Validator.check_schema(out)
    assert_same_meaning(schema, out, valid, invalid)


def test_annotations_and_extensions_are_dropped():
    out = normalize(BY_NAME["annotations_and_extensions"])
    assert not keywords(out) & {"title", "description", "x-taplo", "examples", "$comment", "x-order", "default",
                                "deprecated", "readOnly", "writeOnly"}


def test_rewrites_leave_what_a_grammar_reads():
    """The point of each rule: nothing beside $ref/anyOf/oneOf, no allOf, if or not left."""
    by = {name: normalize(schema) for name, schema, _, _ in EXACT}
    assert by["ref_with_siblings"]["properties"]["p"] == {"type": "integer", "minimum": 0, "maximum": 5}
    assert "allOf" not in keywords(by["allOf_two"]) and by["allOf_two"]["required"] == ["a", "b"]
    assert by["allOf_closed_part"]["properties"]["b"] is False    # a closed part forbids b
    assert "not" not in keywords(by["not_required_is_absent"]) and by["not_required_is_absent"]["properties"]["b"] is False
    assert "anyOf" in by["oneOf_required_and_forbidden"] and "oneOf" not in keywords(by["oneOf_required_and_forbidden"])
    assert by["allOf_bounds_types_enums"] == {"enum": [1, 2, 3]}
    assert "allOf" in by["allOf_patterns_kept"]                   # two patterns cannot be one
    assert set(by["beside_oneOf"]) == {"anyOf"}                   # disjoint by the kind discriminator
    assert set(by["oneOf_overlapping"]) == set(by["oneOf_objects_overlapping"]) == {"oneOf"}
    for branch in by["beside_oneOf"]["anyOf"] + by["oneOf_overlapping"]["oneOf"]:
        assert "type" in branch
    ite = by["if_then_else_enum"]
    assert not keywords(ite) & {"if", "then", "else", "not"}
    assert [b["properties"]["unit"] for b in ite["anyOf"]] == [{"enum": ["c"]}, {"enum": ["f"]}]
    assert [b["properties"]["t"]["maximum"] for b in ite["anyOf"]] == [60, 140]
    assert "if" in by["if_not_rewritable"]
    assert "dependentRequired" not in keywords(by["dependentRequired"])
    assert by["enum_filtered"] == {"enum": ["ok"]}
    assert by["not_beside_enum"] == {"enum": ["a", "c"]}
    assert by["integer_bounds"] == {"type": "integer", "minimum": 1, "maximum": 4}
    assert by["required_undeclared"]["properties"]["b"] == {"type": "integer"}
    assert by["bounds_conflict_drops_type"] == {"type": "null"}


def test_recursion_stays_recursion():
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "description": "a tree node"}}}
    out = normalize(tree)
    assert out["$ref"] == "#/$defs/node"
    assert out["$defs"]["node"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/node"}
    assert_same_meaning(tree, out, [{"v": 1, "kids": [{"v": 2, "kids": []}]}], [{"v": 1, "kids": [{"kids": []}]}])
    # a reference with keywords beside it, met again inside itself, becomes a $defs entry
    rec = BY_NAME["recursive_ref_with_sibling"]
    out = normalize(rec)
    assert out["properties"]["next"]["maxProperties"] == 1              # inlined once
    entry = out["properties"]["next"]["properties"]["next"]["$ref"]      # then referred to
    assert entry.startswith("#/$defs/") and out["$defs"][entry.rsplit("/", 1)[1]]["maxProperties"] == 1


def test_long_chain_of_refs_with_siblings():
    # each $ref has a keyword beside it, each to the next definition: inlined 16 deep, then entries
    defs = {f"D{i}": {"type": "object", "properties": {
        "n": {"$ref": f"#/$defs/D{(i + 1) % 500}", "minProperties": 1}, "v": {"type": "integer"}}} for i in range(500)}
    schema = {"$ref": "#/$defs/D0", "$defs": defs}
    out = normalize(schema)
    deep: dict = {"v": 0}
    for i in range(40):
        deep = {"v": i, "n": deep}
    bad = copy.deepcopy(deep)
    bad["n"]["n"]["n"]["n"] = {}
    assert_same_meaning(schema, out, [deep], [bad])


# a large schema in the style of generated API schemas (the shared acceptance check's "large")
_defs = {}
for _i in range(120):
    _defs[f"D{_i}"] = {"type": "object", "additionalProperties": False, "properties": {
        f"f{j}": ({"$ref": f"#/definitions/D{(_i + j + 1) % 120}"} if j == 0 and _i % 10 == 0 else
                  [S, {"type": "integer"}, {"type": "boolean"}, {"enum": [f"v{k}" for k in range(8)]},
                   {"type": "array", "items": S, "maxItems": 2}][j % 5]) for j in range(12)}}
LARGE = {"$ref": "#/definitions/D0", "definitions": _defs}


def test_repeated_merge_is_one_shared_entry():
    """A $ref with siblings (or an allOf) met again is the same schema: its second use refers to a
    $defs entry holding the first's result instead of expanding it again, and enum-only branches
    are one enum, not a branch each: a CI config's step ({"type": "object", "$ref": task}, task an
    anyOf of hundreds of tasks each naming itself by a pattern that the common `task` property's
    anyOf of names must meet) normalizes into a few thousand nodes, not hundreds of thousands."""
    names = [f"Tool{i}@{v}" for i in range(150) for v in (1, 2)]
    task = {"type": "object", "additionalProperties": False,
            "properties": {"task": {"anyOf": [{"enum": [n], "description": f"the {n} task"} for n in names]},
                           "inputs": {"type": "object"}, "name": S},
            "anyOf": [{"properties": {"task": {"pattern": f"^{n}$"}, "inputs": {"properties": {"x": S}}},
                       "required": ["task"]} for n in names]}
    schema = {"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "$ref": "#/definitions/task"}},
        "post": {"type": "array", "items": {"type": "object", "$ref": "#/definitions/task"}}},
              "definitions": {"task": task}}
    out = normalize(schema)
    ref = out["properties"]["post"]["items"]["$ref"]
    assert out["$defs"][ref.rsplit("/", 1)[1]] is out["properties"]["steps"]["items"]
    assert len(json.dumps(out)) < 20 * len(json.dumps(schema))
    valid = [{"steps": [{"task": "Tool3@2", "inputs": {"x": "a"}}], "post": [{"task": "Tool9@1"}]}]
    invalid = [{"steps": [{"task": "Tool3@3"}]}, {"post": [{"task": "Tool3@2", "inputs": {"x": 1}}]},
               {"steps": [{"name": "no task"}]}]
    assert_same_meaning(schema, out, valid, invalid)


def test_large_schema_of_many_definitions():
    out = normalize(LARGE)
    assert out["$ref"] == "#/definitions/D0"
    assert out["definitions"]["D0"]["properties"]["f0"] == {"$ref": "#/definitions/D1"}
    assert len(out["definitions"]) == 2   # only what D0 reaches


# ---------------------------------------------------------------- narrowing


NARROWING = [
    ("untyped_object", {"properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                        "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ann", "age": 41}, {"type": "object"}),
    ("untyped_format", {"format": "date"}, "2024-01-31", {"type": "string"}),
    ("untyped_mixed", {"minimum": 0, "maxLength": 3}, "ab", {"type": ["string", "number"]}),
    ("untyped_in_anyOf", {"anyOf": [{"required": ["a"]}, {"type": "null"}]}, {"a": 1}, None),
    ("draft7_dependencies", {"type": "object", "properties": {"a": S, "b": S}, "dependencies": {"a": ["b"]}},
     {"a": "x", "b": "y"}, None),
]


@pytest.mark.parametrize("name,schema,example,expect", NARROWING, ids=[c[0] for c in NARROWING])
def test_narrowing_rule_never_widens(name, schema, example, expect):
    out = normalize(schema)
    assert validator(out).is_valid(example) and validator(schema).is_valid(example)
    assert_same_meaning(schema, out, [example], [], narrows=True)
    if expect:
        assert expect.items() <= out.items()


def test_no_type_added_where_narrowing_would_widen():
    # inside `not` a narrower schema would let more through: the keywords stay untyped
    schema = {"type": "object", "properties": {"a": {"not": {"maxLength": 2}}}}
    out = normalize(schema)
    assert out["properties"]["a"] == {"not": {"maxLength": 2}}
    assert_same_meaning(schema, out, [{"a": "abc"}, {}], [{"a": "ab"}, {"a": 5}])
    # the same for a $defs entry such a place refers to
    schema = {"$defs": {"short": {"maxLength": 2}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/short"}, "b": {"not": {"$ref": "#/$defs/short"}}}}
    assert normalize(schema)["$defs"]["short"] == {"maxLength": 2}


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-3, 200) | st.sampled_from(["c", "f", "", "abc"]),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                        st.sampled_from(["unit", "t", "name", "age", "kind", "r", "side"]), kids, max_size=4),
                    max_leaves=8))
def test_any_json_value_gets_the_same_answer(value):
    for schema in (UNIT, BY_NAME["beside_oneOf"], NARROWING[0][1]):
        out = normalize(schema)
        if schema is NARROWING[0][1]:
            assert not validator(out).is_valid(value) or validator(schema).is_valid(value)
        else:
            assert validator(out).is_valid(value) == validator(schema).is_valid(value)
