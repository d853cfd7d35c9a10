"""Schemas as bundlers and generators write them (tests/structured/fresh/, the tuning sample):
references into embedded resources ($id below the root), a schema that extends a recursive one
(widened, then checked), an entry nothing satisfies referred to where it may be absent. Each is
served, and what the grammar is given admits every instance the schema as sent admits (jsonschema
decides both)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from radixflow.services.grammar import drafts
from radixflow.services.grammar.lint import prepare
from radixflow.services.grammar.normalize import widened
from radixflow.services.grammar.resources import for_engines, localize

FRESH = Path(__file__).parent / "structured" / "fresh" / "schemas"


def agree(original: dict, served: dict, instances: list) -> None:
    """`served` (what a grammar is given) decides each instance as `original` does."""
    a = validator_for(original, default=Draft202012Validator)(original)
    b = Draft202012Validator(served)
    for x in instances:
        assert a.is_valid(x) == b.is_valid(x), (x, a.is_valid(x))


COMPOUND = {
    "$id": "https://example.com/root.json",
    "type": "object",
    "properties": {
        "home": {"$ref": "address.json"},                                     # relative to the root's $id
        "street": {"$ref": "https://example.com/address.json#/$defs/street"},  # a pointer into a resource
        "tag": {"$ref": "#tag"},                                              # an anchor of the root
        "zip": {"$ref": "https://example.com/address.json#zip"},              # an anchor of a resource
    },
    "$defs": {
        "address": {
            "$id": "https://example.com/address.json",
            "type": "object",
            # "#/$defs/street" here is the resource's own entry, not the root's
            "properties": {"street": {"$ref": "#/$defs/street"}, "zip": {"$ref": "#zip"}},
            "required": ["street"],
            "$defs": {"street": {"type": "string", "maxLength": 5},
                      "zip": {"$anchor": "zip", "type": "string", "pattern": "^[0-9]{5}$"}},
        },
        "street": {"type": "integer"},       # the root's own "street": what a root-relative reading would take
        "tag": {"$anchor": "tag", "enum": ["a", "b"]},
    },
}
COMPOUND_CASES = [{}, {"home": {"street": "elm"}}, {"home": {"street": 3}}, {"home": {"street": "elm st 12"}},
                  {"street": "oak"}, {"street": 4}, {"tag": "a"}, {"tag": "c"}, {"zip": "12345"}, {"zip": "1234"},
                  {"home": {"street": "x", "zip": "99999"}}, {"home": {"street": "x", "zip": "9"}}]


def test_references_into_embedded_resources_become_pointers():
    local = localize(COMPOUND)
    refs = json.dumps(local)
    assert '"$ref": "https:' not in refs and "address.json" not in refs
    assert "$id" not in json.dumps(local["$defs"])                 # identifiers below the root dropped
    agree(COMPOUND, local, COMPOUND_CASES)
    prepared, level = prepare(COMPOUND)
    agree(COMPOUND, prepared, COMPOUND_CASES)


def test_older_drafts_name_resources_as_their_draft_does():
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "id": "http://example.com/r.json",
              "type": "object", "properties": {"p": {"$ref": "p.json#/definitions/v"}},
              "definitions": {"p": {"id": "http://example.com/p.json", "definitions": {"v": {"type": "boolean"}}}}}
    assert drafts.id_keyword(draft4) == "id"
    local = localize(draft4, "id")
    assert local["properties"]["p"]["$ref"] == "#/definitions/p/definitions/v"
    agree(draft4, prepare(draft4)[0], [{"p": True}, {"p": 1}, {}])
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"p": {"$ref": "#flag"}}, "definitions": {"f": {"$id": "#flag", "type": "boolean"}}}
    agree(draft7, prepare(draft7)[0], [{"p": True}, {"p": 1}, {}])


def test_a_root_identifier_with_a_fragment_is_not_given_to_an_engine():
    """llguidance refuses to resolve against `"$id": "release-it#release-it"` (as release-it ships
    it); no reference needs the root's identifier once all are local."""
    schema = {"$id": "release-it#release-it", "type": "object", "properties": {"git": {"$ref": "#/definitions/git"}},
              "definitions": {"git": {"type": "boolean"}}}
    assert "$id" not in for_engines(schema)
    remote = {"$id": "https://example.com/x.json", "properties": {"y": {"$ref": "y.json"}}}
    assert for_engines(remote)["$id"] == "https://example.com/x.json"      # still needed: kept


def test_a_schema_that_extends_a_recursive_one_is_widened_and_checked():
    """AsyncAPI's schema object is allOf [the Draft 7 metaschema, keywords of its own], each
    recursive: merged exactly it grows past every bound (25 s to give up). The conjunctions of
    references keep their first, so the grammar admits more, and the output is checked."""
    original = json.loads((FRESH / "asyncapi__bindings-mqtt-0.2.0-server.json").read_text())
    served, wider = widened(drafts.to_2020(localize(original)))
    assert wider
    _, level = prepare(original)
    assert level == "checked"
    valid = [{}, {"bindingVersion": "0.2.0"}, {"clientId": "guest", "cleanSession": True, "keepAlive": 60},
             {"lastWill": {"topic": "/last-wills", "qos": 2, "message": "bye", "retain": False}}]
    check = validator_for(original)(original)
    assert all(check.is_valid(x) for x in valid)
    wide = Draft202012Validator(served)
    assert all(wide.is_valid(x) for x in valid)            # widened: never narrower


def test_an_entry_nothing_satisfies_is_absent_where_it_is_optional():
    """additionalProperties: false beside a oneOf whose branches need properties admits nothing (the
    parent's own properties are none): octokit's webhooks ship such a definition. Referred to by an
    optional property, it makes that property absent, not the schema unsatisfiable, and no engine
    is given a `false` entry."""
    schema = {"type": "object", "properties": {"loc": {"$ref": "#/definitions/loc"}, "n": {"type": "integer"}},
              "definitions": {"loc": {"type": "object", "additionalProperties": False, "oneOf": [
                  {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["commit"]}}},
                  {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["issue"]}}}]}}}
    prepared, _ = prepare(schema)
    assert False not in prepared.get("definitions", {}).values()
    assert False not in prepared.get("$defs", {}).values()
    # the grammar writes only declared properties: "loc" is either undeclared or false, never written
    assert prepared["properties"].get("loc", False) is False and prepared["properties"]["n"] == {"type": "integer"}
    needed = dict(schema, required=["loc"])
    with pytest.raises(Exception, match="unsatisfiable"):
        prepare(needed)
