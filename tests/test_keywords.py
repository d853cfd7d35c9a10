"""Every keyword of JSON Schema Draft 2020-12 (core, applicator, unevaluated, validation, meta-data,
format, content vocabularies) and every Draft 7 keyword that 2020-12 renamed or dropped: each one
compiles and is enforced (full), is relaxed in the grammar and checked (the finished output is
validated and resampled), or is refused with a 400 that names it. What a grammar produces for each
is walked at random (no model) and validated with jsonschema: at level full every finished output
is valid; at level checked the validator decides (and at least one walk of each is valid, so a
resample can succeed). The one class xgrammar cannot be given (dynamic references) goes to
llguidance under `auto`: it compiles there."""
from __future__ import annotations

import json
import random
import zlib

import pytest
import xgrammar as xgr
from jsonschema.validators import validator_for

from radixflow.services.grammar.keys import JSON_OPTIONS
from radixflow.services.grammar.lint import prepare
from radixflow.services.grammar.merge import Unsupported
from radixflow.services.grammar.tokenizer_info import make_tokenizer_info
from radixflow.shared.errors import BadRequest
from .structured.walk import Walker

D7 = "http://json-schema.org/draft-07/schema#"
OBJ = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "string", "maxLength": 4}}}
# if/then/else testing properties by value: their negation (else) is the rest of an enum, which a
# grammar says exactly (a range's negation is not: that `not` is checked)
CHOICE = {"type": "object", "properties": {"a": {"enum": [0, 1, 2]}, "b": {"enum": ["x", "y"]}}}

# keyword -> (a schema using it, the level prepare gives: full | checked | llguidance)
KEYWORDS_2020 = {
    # core
    "$schema": ({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "boolean"}, "full"),
    "$id": ({"$id": "https://example.com/s.json", "type": "object", "properties": {"x": {"$ref": "t.json"}},
             "$defs": {"t": {"$id": "https://example.com/t.json", "type": "integer", "maximum": 3}}}, "full"),
    "$ref": ({"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "null"}}}, "full"),
    "$anchor": ({"type": "object", "properties": {"x": {"$ref": "#small"}},
                 "$defs": {"n": {"$anchor": "small", "type": "integer", "maximum": 2}}}, "full"),
    "$dynamicRef": ({"$dynamicAnchor": "node", "type": "object",
                     "properties": {"kid": {"$dynamicRef": "#node"}, "v": {"type": "integer"}}}, "llguidance"),
    "$dynamicAnchor": ({"$dynamicAnchor": "top", "type": "integer"}, "full"),
    "$vocabulary": ({"$vocabulary": {"https://json-schema.org/draft/2020-12/vocab/core": True}, "type": "null"}, "full"),
    "$comment": ({"$comment": "a note", "type": "string", "maxLength": 3}, "full"),
    "$defs": ({"$defs": {"d": {"type": "boolean"}}, "$ref": "#/$defs/d"}, "full"),
    # applicator
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 2}],
                     "items": False}, "full"),
    "items": ({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, "full"),
    "contains": ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                  "contains": {"const": 2}, "maxItems": 4}, "checked"),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "null"}},
                              "additionalProperties": {"type": "boolean"}, "maxProperties": 3}, "full"),
    "properties": (OBJ, "full"),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, "checked"),
    "dependentSchemas": ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, "full"),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-c]$"}, "maxProperties": 2}, "full"),
    "if": ({**CHOICE, "if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "then": {"required": ["b"]}}, "full"),
    "then": ({**CHOICE, "if": {"properties": {"b": {"const": "x"}}}, "then": {"properties": {"a": {"enum": [0, 1]}}}},
             "full"),
    "else": ({**OBJ, "if": {"required": ["a"]}, "else": {"required": ["b"]}}, "full"),
    "allOf": ({"allOf": [OBJ, {"required": ["a"]}]}, "full"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "full"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, "full"),
    "not": ({"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}}, "checked"),
    # unevaluated
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, "full"),
    "unevaluatedProperties": ({"type": "object", "allOf": [OBJ], "unevaluatedProperties": False}, "full"),
    # validation
    "type": ({"type": ["string", "null"], "maxLength": 3}, "full"),
    "const": ({"const": {"k": [1, 2]}}, "full"),
    "enum": ({"enum": ["red", 3, None, [1]]}, "full"),
    "multipleOf": ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 50}, "full"),
    "maximum": ({"type": "number", "maximum": 2.5}, "full"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 4}, "full"),
    "minimum": ({"type": "number", "minimum": -1}, "full"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 2, "maximum": 9}, "full"),
    "maxLength": ({"type": "string", "maxLength": 2}, "full"),
    "minLength": ({"type": "string", "minLength": 2, "maxLength": 5}, "full"),
    "pattern": ({"type": "string", "pattern": "^[a-f0-9]{2,4}$"}, "full"),
    "maxItems": ({"type": "array", "items": {"type": "null"}, "maxItems": 2}, "full"),
    "minItems": ({"type": "array", "items": {"type": "null"}, "minItems": 1, "maxItems": 3}, "full"),
    "uniqueItems": ({"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3}, "checked"),
    "maxContains": ({"type": "array", "items": {"enum": [1, 2]}, "contains": {"const": 1}, "maxContains": 1,
                     "maxItems": 3}, "checked"),
    "minContains": ({"type": "array", "items": {"enum": [1, 2]}, "contains": {"const": 1}, "minContains": 2,
                     "minItems": 2, "maxItems": 2}, "checked"),
    "maxProperties": ({**OBJ, "maxProperties": 1}, "full"),
    "minProperties": ({**OBJ, "minProperties": 1}, "full"),
    "required": ({**OBJ, "required": ["a", "b"]}, "full"),
    "dependentRequired": ({**OBJ, "dependentRequired": {"a": ["b"]}}, "full"),
    # meta-data (annotations)
    "title": ({"title": "T", "type": "boolean"}, "full"),
    "description": ({"description": "D", "type": "boolean"}, "full"),
    "default": ({"default": 1, "type": "integer", "maximum": 3}, "full"),
    "deprecated": ({"deprecated": True, "type": "null"}, "full"),
    "readOnly": ({"readOnly": True, "type": "null"}, "full"),
    "writeOnly": ({"writeOnly": True, "type": "null"}, "full"),
    "examples": ({"examples": ["ab"], "type": "string", "maxLength": 2}, "full"),
    # format (annotation in 2020-12, asserted here: approximated in the grammar, then checked)
    "format": ({"type": "string", "format": "date"}, "checked"),
    # content (annotations in 2020-12)
    "contentEncoding": ({"type": "string", "contentEncoding": "base64", "maxLength": 8}, "full"),
    "contentMediaType": ({"type": "string", "contentMediaType": "application/json", "maxLength": 8}, "full"),
    "contentSchema": ({"type": "string", "contentMediaType": "application/json", "contentSchema": {"type": "integer"},
                       "maxLength": 8}, "full"),
}

# Draft 7 keywords (and forms) that 2020-12 renamed or dropped
KEYWORDS_7 = {
    "definitions": ({"$schema": D7, "definitions": {"d": {"type": "null"}}, "$ref": "#/definitions/d"}, "full"),
    "dependencies (names)": ({"$schema": D7, **OBJ, "dependencies": {"a": ["b"]}}, "full"),
    "dependencies (schema)": ({"$schema": D7, **OBJ, "dependencies": {"a": {"required": ["b"]}}}, "full"),
    "items (array)": ({"$schema": D7, "type": "array", "items": [{"type": "integer"}, {"type": "null"}]}, "full"),
    "additionalItems": ({"$schema": D7, "type": "array", "items": [{"type": "integer"}],
                         "additionalItems": {"type": "string", "maxLength": 2}, "maxItems": 3}, "full"),
    "$id (plain name)": ({"$schema": D7, "type": "object", "properties": {"x": {"$ref": "#n"}},
                          "definitions": {"n": {"$id": "#n", "type": "boolean"}}}, "full"),
    "exclusiveMinimum (draft 4 boolean)": ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
                                            "minimum": 0, "exclusiveMinimum": True, "maximum": 3}, "full"),
}
CASES = {**KEYWORDS_2020, **{f"draft7 {k}": v for k, v in KEYWORDS_7.items()}}

# refused: each with the words a user acts on
REFUSED = [
    ({"type": "object", "properties": {"x": {"$ref": "https://example.com/elsewhere.json"}}}, "only references within"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "unsatisfiable"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "unsatisfiable"),
    ({"type": "string", "minLength": -1}, "invalid JSON Schema"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
]


@pytest.fixture(scope="module")
def grammar(models):
    info = make_tokenizer_info(models["tiny-hybrid"])
    return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False), Walker(info), info.decoded_vocab


def test_every_keyword_is_covered():
    """The table names every keyword of the 2020-12 vocabularies (the dialect metaschema's)."""
    from jsonschema_specifications import REGISTRY
    names: set[str] = set()
    for uri in REGISTRY:
        if uri.startswith("https://json-schema.org/draft/2020-12/meta/"):
            names |= set(REGISTRY.contents(uri).get("properties", {}))
    assert len(names) >= 55 and names <= set(KEYWORDS_2020), sorted(names - set(KEYWORDS_2020))


@pytest.mark.parametrize("name", list(CASES))
def test_keyword_is_enforced_checked_or_handed_on(name, grammar):
    schema, expected = CASES[name]
    if expected == "llguidance":
        with pytest.raises(Unsupported, match=name.split()[0].replace("$", r"\$")):
            prepare(schema)           # xgrammar's refusal, naming it; llguidance compiles it (below)
        return
    prepared, level = prepare(schema)
    assert level == expected, (name, prepared)
    compiler, walker, vocab = grammar
    compiled = compiler.compile_json_schema(json.dumps(prepared), **JSON_OPTIONS)
    check = validator_for(schema)(schema, format_checker=validator_for(schema).FORMAT_CHECKER)
    rng, finished, valid = random.Random(zlib.crc32(name.encode())), 0, 0
    for value in walker.values(compiled, vocab, rng, walks=24, max_tokens=120):
        finished += 1
        ok = check.is_valid(value)
        valid += ok
        if level == "full":
            assert ok, f"{name}: {value!r}: {next(check.iter_errors(value)).message}"
    assert finished >= 4 and valid >= 1, (name, finished, valid)


def test_dynamic_references_compile_with_llguidance(models):
    from radixflow.services.grammar.backends.llguidance import LLGuidanceBackend
    backend = LLGuidanceBackend(models["tiny-hybrid"])
    schema, _ = CASES["$dynamicRef"]
    assert backend.compile("json_schema", json.dumps(schema)).raw


@pytest.mark.parametrize("schema,words", REFUSED)
def test_refusals_name_what_to_change(schema, words):
    with pytest.raises(BadRequest, match=words) as e:
        prepare(schema)
    assert e.value.code == 400
