"""lint.prepare on top of normalize: enforcement levels (full or checked), the shared acceptance
check's schemas compiled and walked with xgrammar, the compiler compiling the prepared schema under
the original key, and older drafts read as 2020-12 (drafts.py)."""
from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr
from jsonschema import Draft202012Validator

from radixflow.services.grammar.compiler import _VALIDATED_WARNINGS, Compiler
from radixflow.services.grammar.keys import JSON_OPTIONS, canonicalize, grammar_key
from radixflow.services.grammar.lint import check_schema, prepare, widen_for_llguidance
from radixflow.services.grammar.tokenizer_info import make_tokenizer_info
from radixflow.shared.errors import BadRequest
from .structured.walk import Walker

from .test_normalize import BY_NAME, EXACT, LARGE, NARROWING, UNIT, S, instances, keywords, validator


# ---------------------------------------------------------------- prepare: enforcement levels


@pytest.mark.parametrize("schema,level,gone", [
    ({"type": "object", "properties": {"a": S}, "required": ["a"]}, "full", set()),
    (UNIT, "full", set()),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "checked", {"uniqueItems"}),
    ({"type": "string", "maxLength": 5, "not": {"const": "abc"}}, "checked", {"not"}),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, "checked", {"if", "then"}),
    ({"type": "array", "contains": {"const": 3}, "maxItems": 3}, "checked", {"contains"}),
    ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}, "checked", {"patternProperties"}),
    ({"type": "number", "multipleOf": 0.5, "maximum": 3}, "checked", {"multipleOf"}),
    ({"type": "string", "format": "regex"}, "checked", {"format"}),
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{8}$"}, "checked", set()),
    ({"type": "string", "format": "date"}, "checked", set()),                 # approximate (needs_validation)
    ({"type": "object", "properties": {"a": S, "b": S}, "dependentRequired": {"a": ["b"]}}, "full", {"dependentRequired"}),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 1}]}, "checked", set()),
])
def test_prepare_enforcement_level(schema, level, gone):
    out, got = prepare(schema)
    assert got == level, out
    assert not keywords(out) & gone
    # what the grammar compiles only widens the normalized schema: every valid instance stays valid
    vo, vp = validator(schema), validator(out)
    for x in instances(schema):
        if vo.is_valid(x):
            assert vp.is_valid(x), (x, out)


def test_lookarounds_leave_the_rest_of_the_pattern():
    assert prepare({"type": "string", "pattern": "^(?=.*[0-9])(?!x)[a-z0-9]{8}$"})[0]["pattern"] == "^[a-z0-9]{8}$"
    # a quantified lookaround is not simply removable: the pattern goes
    assert "pattern" not in prepare({"type": "string", "pattern": "^a(?=b)?c$"})[0]


def test_a_minimum_beyond_what_is_declared_is_written_out(info):
    """xgrammar's strict mode closes an array (object) that declares no items (additionalProperties)
    and then refuses a minItems (minProperties) beyond what it declares: absent means anything, and
    the prepared schema says so (the same meaning: full); xgrammar compiles it."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 1},
                                               "o": {"type": "object", "minProperties": 1}}, "required": ["a", "o"]}
    prepared, level = prepare(schema)
    assert prepared["properties"]["a"]["items"] == {} and prepared["properties"]["o"]["additionalProperties"] == {}
    assert level == "full"
    xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False).compile_json_schema(json.dumps(prepared),
                                                                                      **JSON_OPTIONS)
    # closed by the schema itself, with its patternProperties dropped (checked): opened, checked
    closed = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False,
              "minProperties": 1}
    prepared, level = prepare(closed)
    assert prepared["additionalProperties"] == {} and level == "checked"


def test_widen_for_llguidance_only_widens_patterns_and_bounds():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^(?!aws:)[a-z]+$", "maxLength": 8},
        "b": {"type": "string", "pattern": "\\A[^\\n]*\\Z"},
        "c": {"type": "string", "pattern": "[\\b]x\\\\b"},                # a backspace, a literal backslash-b
        "d": {"type": "string", "pattern": "^a(?=b)?c$"},                 # quantified: the pattern goes
        "e": {"enum": [{"pattern": "(?!x)"}]},                             # a value, not a schema
        "f": {"type": "object", "patternProperties": {"^(?!:).+": {"type": "integer"}}}}}
    wide = widen_for_llguidance(schema)
    props = wide["properties"]
    assert props["a"] == {"type": "string", "pattern": "^[a-z]+$"}
    assert props["b"]["pattern"] == "[^\\n]*" and props["c"]["pattern"] == "[\\b]x\\\\b"
    assert "pattern" not in props["d"] and props["e"] == schema["properties"]["e"]
    assert props["f"]["patternProperties"] == {"^.+": {"type": "integer"}}
    several = {"type": "object", "patternProperties": {"^": {}, "^x-": {}}}
    assert "patternProperties" not in widen_for_llguidance(several)
    assert widen_for_llguidance({"type": "string", "pattern": "^[a-z]+$"}) is None       # nothing to widen
    # every instance of the original validates against the widened copy
    v = Draft202012Validator(wide)
    for doc in ({"a": "abc"}, {"b": "line"}, {"d": "ac"}, {"f": {"k": 1}}):
        assert Draft202012Validator(schema).is_valid(doc) and v.is_valid(doc), doc


# ---------------------------------------------------------------- the acceptance check's schemas

ACCEPTANCE = {   # a copy of SCHEMAS in the shared acceptance check (structured.py)
    "untyped-object": NARROWING[0][1],
    "allOf-two": BY_NAME["allOf_two"],
    "beside-oneOf": BY_NAME["beside_oneOf"],
    "if-then-else": UNIT,
    "uniqueItems": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d", "e"]},
                    "minItems": 2, "maxItems": 4, "uniqueItems": True}}, "required": ["tags"], "additionalProperties": False},
    "not": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$", "not": {"enum": ["AAA", "ZZZ"]}}},
            "required": ["code"], "additionalProperties": False},
    "extension-keywords": {"type": "object", "x-taplo": {"hidden": True}, "title": "Cfg", "examples": [{"v": 1}],
                           "properties": {"v": {"type": "integer", "x-tombi-order": "asc", "minimum": 0, "maximum": 9}},
                           "required": ["v"], "additionalProperties": False},
    "untyped-format": {"type": "object", "properties": {"when": {"format": "date"}, "mail": {"type": "string", "format": "email", "maxLength": 40}},
                       "required": ["when", "mail"], "additionalProperties": False},
}
ACCEPTANCE["large"] = LARGE
ACCEPTANCE_LEVEL = {"uniqueItems": "checked", "not": "checked", "untyped-format": "checked"}


@pytest.fixture(scope="module")
def info(models):
    return make_tokenizer_info(models["tiny-hybrid"])


def test_acceptance_schemas_compile(info, capfd):
    """Accepted (no 400), at the expected level, compiled by xgrammar with no warning beyond those
    the compiler lets through (they are approximations needs_validation marks as checked)."""
    c = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    for name, schema in ACCEPTANCE.items():
        check_schema(schema)
        prepared, level = prepare(schema)
        assert level == ACCEPTANCE_LEVEL.get(name, "full"), name
        capfd.readouterr()
        c.compile_json_schema(json.dumps(prepared), **JSON_OPTIONS)
        warnings = [w for w in capfd.readouterr().err.splitlines() if "Warning" in w]
        assert all(any(a in w for a in _VALIDATED_WARNINGS) for w in warnings), (name, warnings)
        assert not warnings or level == "checked"


class _FakeWorker:
    """Stands in for a compile process: records what it was sent."""
    def __init__(self):
        self.sent: list[tuple] = []

    def run(self, *args):
        self.sent.append(args)
        return ("ok", b"blob", 4, 0.0, "full", [], [])   # the engine enforces all it was sent


async def test_compiler_compiles_the_prepared_schema_under_the_original_key():
    compiler = Compiler("/nonexistent", workers=1, backend="xgrammar")
    worker = _FakeWorker()
    compiler.pool.give(worker)
    try:
        spec = json.dumps(UNIT)
        first = await compiler.compile("json_schema", spec)
        prepared, level = prepare(UNIT)
        assert json.dumps(prepared, separators=(",", ":")) in worker.sent[0]   # not the original text
        assert first.key == grammar_key(canonicalize("json_schema", spec), compiler.identity)
        assert first.enforcement == level == "full" and not first.cache_hit
        checked = await compiler.compile("json_schema", json.dumps(ACCEPTANCE["uniqueItems"]))
        assert checked.enforcement == "checked"
        again = await compiler.compile("json_schema", json.dumps(UNIT, indent=2))
        assert again.cache_hit and again.key == first.key and len(worker.sent) == 2
    finally:
        await compiler.stop()


def test_full_grammars_only_produce_valid_output(info):
    """Random walks through each prepared grammar: at level full, every finished output validates
    against the ORIGINAL schema."""
    c = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    walker, vocab, rng = Walker(info), info.decoded_vocab, random.Random(0)
    schemas = {**ACCEPTANCE, **{n: s for n, s, _, _ in EXACT}}
    finished = 0
    for name, schema in schemas.items():
        prepared, level = prepare(schema)
        g = c.compile_json_schema(json.dumps(prepared), **JSON_OPTIONS)
        v = validator(schema)
        for value in walker.values(g, vocab, rng, walks=4, max_tokens=200):
            finished += 1
            if level == "full":
                err = next(iter(v.iter_errors(value)), None)
                assert err is None, f"{name}: {value!r}: {err.message}"
    assert finished >= 60


# ---------------------------------------------------------------- older drafts (drafts.py)


DRAFT_CASES = [
    # Draft 4: boolean exclusive bounds, id
    ({"$schema": "http://json-schema.org/draft-04/schema#", "id": "http://x/y", "type": "number", "minimum": 0,
      "exclusiveMinimum": True, "maximum": 5}, [0.5, 5], [0, -1, 6]),
    # Draft 7: items as a list, additionalItems
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"},
      {"type": "string"}], "additionalItems": False}, [[1, "a"], [1]], [["a", 1], [1, "a", 2]]),
    # Draft 6: $id fragments are anchors
    ({"$schema": "http://json-schema.org/draft-06/schema#", "definitions": {"n": {"$id": "#num", "type": "integer"}},
      "type": "object", "properties": {"a": {"$ref": "#num"}}}, [{"a": 1}, {}], [{"a": "x"}]),
    # 2019-09: $recursiveRef to the root
    ({"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": True, "type": "object",
      "properties": {"kid": {"$recursiveRef": "#"}}, "additionalProperties": False},
     [{}, {"kid": {"kid": {}}}], [{"kid": 1}, {"x": 1}]),
]


@pytest.mark.parametrize("schema,valid,invalid", DRAFT_CASES)
def test_older_drafts_become_2020_12_with_the_same_meaning(schema, valid, invalid):
    from jsonschema.validators import validator_for

    from radixflow.services.grammar.drafts import to_2020
    from radixflow.services.grammar.lint import prepare
    up = to_2020(schema)
    Draft202012Validator.check_schema(up)
    orig, new = validator_for(schema)(schema), Draft202012Validator(up)
    for v in valid:
        assert orig.is_valid(v) and new.is_valid(v), v
    for v in invalid:
        assert not orig.is_valid(v) and not new.is_valid(v), v
    prepare(schema)                                   # served, not a 400


def test_a_schema_invalid_under_its_own_draft_is_400():
    from radixflow.services.grammar.drafts import to_2020
    with pytest.raises(BadRequest):
        to_2020({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": 3})
