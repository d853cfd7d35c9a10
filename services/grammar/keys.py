"""Canonical form and cache key of a constraint.

Two requests share a compiled grammar exactly when their canonical forms, the tokenizer, the
grammar engine (xgrammar or llguidance), its version and our compile options are the same; a
constraint compiled by both engines is two entries:

    json_schema   the parsed JSON re-serialized compactly; whitespace-insensitive, but property
                  ORDER is kept: xgrammar makes the model write properties in declared order
    json_object   a fixed text (it is compiled as JSON_OBJECT_SCHEMA)
    regex, ebnf   the text as given (no safe normal form exists)
    choice        the JSON list of strings, deduplicated and sorted (matching one of a set does
                  not depend on the order it was listed in)
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from radixflow.shared.errors import BadRequest

KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
BACKENDS = ("xgrammar", "llguidance")

# Whitespace: any whitespace, at most 2 characters per gap. Unbounded whitespace lets a model loop
# on newlines forever (a known failure with small/quantized models), and forced compact separators
# fight a model that wants ", " or ": " (xgrammar reports lower quality with them). Two characters
# keep ", ", ": ", "{ " and a lone newline; pretty-printed indentation is cut short but stays valid.
# strict_mode: no properties or items beyond those the schema declares (see lint.py).
JSON_OPTIONS: dict[str, Any] = {"any_whitespace": True, "max_whitespace_cnt": 2, "strict_mode": True}

# xgrammar's builtin JSON grammar allows unbounded whitespace; this schema gets the same bound as
# every other JSON output. additionalProperties must be explicit: strict mode closes objects.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "additionalProperties": True}

# llguidance's JSON options (overriding any "x-guidance" in the schema): the same whitespace bound;
# keywords it does not implement are ignored and oneOf is read as anyOf, both validated afterwards
# (backends/llguidance.py).
LLGUIDANCE_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,2}", "item_separator": ",", "key_separator": ":",
    "lenient": True, "coerce_one_of": True}

# Bump when lint or compile semantics change, so old cache entries are never reused.
POLICY = "rf-grammar-2"      # 2: schemas are normalized and relaxed before compiling (lint.prepare)

_OPTIONS_TAG = {
    "xgrammar": json.dumps({"json": JSON_OPTIONS, "policy": POLICY, "version": version("xgrammar")}, sort_keys=True),
    "llguidance": json.dumps({"json": LLGUIDANCE_JSON_OPTIONS, "policy": POLICY, "version": version("llguidance")},
                             sort_keys=True),
}


@dataclass(frozen=True)
class Canonical:
    kind: str
    text: str          # what is hashed, and what the worker compiles
    value: Any = None  # the parsed schema (json_schema) or list of choices (choice)


def _parse_json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except ValueError as e:
        raise BadRequest(f"invalid JSON in {what}: {e}", param="response_format") from None
    except RecursionError:
        raise BadRequest(f"{what} is nested too deeply", param="response_format") from None


def canonicalize(kind: str, spec: str) -> Canonical:
    if kind == "json_schema":
        schema = _parse_json(spec, "json_schema")
        if not isinstance(schema, dict):
            raise BadRequest(f"a JSON schema must be a JSON object, got {type(schema).__name__}",
                             param="response_format")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError:   # json.loads takes NaN/Infinity, which are not JSON
            raise BadRequest("invalid JSON in json_schema: NaN and Infinity are not JSON numbers",
                             param="response_format") from None
        return Canonical(kind, text, schema)
    if kind == "json_object":
        return Canonical(kind, "json_object")
    if kind in ("regex", "ebnf"):
        if not spec:
            raise BadRequest(f"a {kind} constraint needs a non-empty spec", param="response_format")
        return Canonical(kind, spec)
    if kind == "choice":
        choices = _parse_json(spec, "choice")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise BadRequest("choice must be a JSON list of non-empty strings", param="choice")
        choices = sorted(set(choices))
        return Canonical(kind, json.dumps(choices, separators=(",", ":"), ensure_ascii=False), choices)
    raise BadRequest(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}", param="response_format")


def grammar_key(canon: Canonical, tokenizer_identity: str, backend: str = "xgrammar") -> str:
    h = hashlib.sha256()
    for part in (canon.kind, canon.text, tokenizer_identity, backend, _OPTIONS_TAG[backend]):
        data = part.encode("utf-8", "surrogatepass")
        h.update(b"%d:" % len(data))     # length-prefixed: no two part lists hash alike
        h.update(data)
    return h.hexdigest()
