"""The honest guarantee: which JSON Schema (Draft 2020-12) constructs the grammar enforces.

xgrammar 0.2.9 compiles a schema into a grammar, but it silently drops or weakens some keywords
(sometimes with a stderr warning, often without). Each row below was measured against the
installed xgrammar by comparing what the grammar accepts with what jsonschema accepts
(any_whitespace, max_whitespace_cnt=2, strict_mode).

| Construct | Status |
|---|---|
| `type` (all seven, and lists such as `["string","null"]`) | enforced |
| `enum`, `const` | enforced (values are written in compact JSON) |
| `minLength`, `maxLength` (code points) | enforced |
| `pattern` | enforced, except lookaround `(?=` `(?!` `(?<=` `(?<!` (rejected); backreferences, `\\b`, `\\p{..}` are compile errors and `^`/`$` mid-pattern is refused (400) |
| `format`: date, time, date-time, duration, email, hostname, ipv4, ipv6, uri, uri-reference, uri-template, json-pointer, relative-json-pointer, uuid | approximate (xgrammar's regexes, e.g. 2024-02-30 passes): validated |
| `format`: regex, iri, iri-reference, idn-email, idn-hostname | rejected (not enforced at all) |
| `format`: any other (custom) value | annotation only, as Draft 2020-12 defines |
| `pattern`/`format` combined with `minLength`/`maxLength`, or `format` with `pattern` | approximate (only the pattern/format is enforced): validated |
| `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` | enforced (integer bounds must be whole numbers) |
| `multipleOf` on `integer` | enforced |
| `multipleOf` on `number` | rejected (ignored by xgrammar) |
| `items`, `prefixItems`, `minItems`, `maxItems`, `unevaluatedItems` | enforced |
| `uniqueItems: true` | rejected (ignored) |
| `contains`, `minContains`, `maxContains` | rejected (ignored) |
| `properties`, `additionalProperties` (bool or schema), `unevaluatedProperties`, `propertyNames`, `minProperties`, `maxProperties` | enforced |
| `required` | enforced for declared properties; a required name missing from `properties` is rejected (ignored) |
| `patternProperties` | rejected (matching keys can never be written) |
| `dependentRequired`, `dependentSchemas`, `dependencies` | rejected (ignored) |
| `anyOf` | enforced |
| `oneOf` | approximate (anyOf semantics unless branches are provably disjoint): validated |
| `allOf` with one subschema | enforced; with several: rejected (ignored) |
| `not`, `if`/`then`/`else` | rejected (ignored) |
| `$ref` to `#` or `#/...` (recursion included), `$defs`, `definitions` | enforced |
| `$ref` to anything else (remote, `#anchor`, relative to `$id`), `$dynamicRef`, `$recursiveRef`, `$id` below the root | rejected (ignored) |
| assertion keywords beside `$ref`, `anyOf` or `oneOf` | rejected (xgrammar ignores the siblings) |
| type-specific keywords (e.g. `maxLength`, `minimum`, `required`, `maxItems`) without a `type` naming that type | rejected (ignored) |
| `enum`/`const` with sibling keywords some value violates | rejected (only the enum is enforced) |
| `title`, `description`, `default`, `examples`, `deprecated`, `readOnly`, `writeOnly`, `$comment`, `$schema`, `$anchor`, `content*` | annotations |

Narrowing (valid output, but not every valid document can be produced): properties come in
declared order; an object that declares `properties` or an array that declares `prefixItems`
takes nothing beyond them unless `additionalProperties`/`items` says so (strict mode); integers
have no fraction or exponent; numbers have no exponent when bounded; enum/const values are
written compactly; a length-bounded string cannot contain escapes (`\\n`, `\\"`, `\\uXXXX`);
whitespace between tokens is at most 2 characters.

Beyond xgrammar: its length-bounded strings admit raw control characters (invalid JSON); the
compile worker patches that class (see worker.json_schema_grammar). Any other warning xgrammar
prints while compiling turns the request into a 400 (compiler._VALIDATED_WARNINGS lists the
three that needs_validation covers).

"validated": `needs_validation(schema)` is True and the finished output must be checked with
jsonschema (Draft202012Validator with its format checker) before it is returned.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from jsonschema import Draft202012Validator, SchemaError

from radixflow.shared.errors import BadRequest

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
    "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema"})
CONTAINERS = frozenset({"$defs", "definitions"})   # hold schemas, assert nothing themselves

# keyword -> the types it applies to; xgrammar ignores it unless `type` names one of them
FAMILY: dict[str, frozenset[str]] = {}
for _types, _kws in (
        ({"string"}, ("minLength", "maxLength", "pattern", "format")),
        ({"integer", "number"}, ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")),
        ({"array"}, ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems")),
        ({"object"}, ("properties", "required", "additionalProperties", "unevaluatedProperties",
                      "propertyNames", "minProperties", "maxProperties"))):
    FAMILY.update({k: frozenset(_types) for k in _kws})

REJECTED = {
    "contains": "xgrammar ignores it", "minContains": "xgrammar ignores it", "maxContains": "xgrammar ignores it",
    "not": "xgrammar ignores it", "if": "xgrammar ignores it", "then": "xgrammar ignores it",
    "else": "xgrammar ignores it", "dependentRequired": "xgrammar ignores it",
    "dependentSchemas": "xgrammar ignores it", "dependencies": "xgrammar ignores it",
    "patternProperties": "keys matching it can never be written; list them in properties",
    "$dynamicRef": "xgrammar ignores it", "$dynamicAnchor": "xgrammar ignores it",
    "$recursiveRef": "xgrammar ignores it", "$recursiveAnchor": "xgrammar ignores it",
}
ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer", "uuid"})
UNENFORCED_FORMATS = frozenset({"regex", "iri", "iri-reference", "idn-email", "idn-hostname"})
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
                  "contains", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_IDENT = re.compile(r"[A-Za-z_$][\w$-]*")


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if _IDENT.fullmatch(key) else f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _walk(schema: Any) -> Iterator[tuple[dict, str, set[str]]]:
    """Every schema object in `schema` with its JSON path and the types it may take; iterative, so
    deep schemas cannot blow the stack."""
    stack: list[tuple[Any, str, set[str] | None]] = [(schema, "$", None)]
    while stack:
        node, path, implied = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, path, _types(node) or implied or set()
        for kw in _SUBSCHEMA_MAPS:
            if isinstance(node.get(kw), dict):
                p = _child(path, kw)
                stack.extend((v, _child(p, k), None) for k, v in node[kw].items())
        for kw in _SUBSCHEMA_ONE:
            if kw in node:
                # property names are strings: xgrammar applies string keywords there without a type
                stack.append((node[kw], _child(path, kw), {"string"} if kw == "propertyNames" else None))
        for kw in _SUBSCHEMA_LISTS:
            if isinstance(node.get(kw), list):
                p = _child(path, kw)
                stack.extend((v, _child(p, i), None) for i, v in enumerate(node[kw]))


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _reject(name: str, path: str, why: str) -> BadRequest:
    return BadRequest(f"unsupported JSON Schema construct '{name}' at {path}: {why}", param="response_format")


def _assertions(node: dict, exclude: tuple[str, ...]) -> list[str]:
    return [k for k in node if k not in ANNOTATIONS and k not in CONTAINERS and k not in exclude]


def _check_node(node: dict, path: str, types: set[str], root: dict) -> None:
    for kw, why in REJECTED.items():
        if kw in node:
            raise _reject(kw, path, why)
    if node.get("uniqueItems") is True:
        raise _reject("uniqueItems", path, "xgrammar ignores it")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise _reject("allOf", path, "only a single-subschema allOf is enforced; merge the subschemas")
    if "$id" in node and node is not root:
        raise _reject("$id", path, "only the root may set $id (references resolve against the root)")
    if "$ref" in node:
        ref = node["$ref"]
        if not (ref == "#" or ref.startswith("#/")):
            raise _reject("$ref", path, f"only local references ('#' or '#/...') are supported, got {ref!r}")
        if extra := _assertions(node, ("$ref",)):
            raise _reject(extra[0], path, "keywords beside '$ref' are ignored; move them into the referenced schema")
    for comb in ("anyOf", "oneOf"):
        if comb in node and (extra := _assertions(node, (comb,))):
            raise _reject(extra[0], path, f"keywords beside '{comb}' are ignored; repeat them in every branch")
    for kw in node:
        need = FAMILY.get(kw)
        if need is not None and not (types & need):
            raise _reject(kw, path, f'it needs "type": "{"/".join(sorted(need))}" in the same schema')
    if "multipleOf" in node and "number" in types:
        raise _reject("multipleOf", path, 'only enforced with "type": "integer"')
    fmt = node.get("format")
    if fmt in UNENFORCED_FORMATS:
        raise _reject("format", path, f"format {fmt!r} is not enforced")
    if isinstance(node.get("pattern"), str) and _LOOKAROUND.search(node["pattern"]):
        raise _reject("pattern", path, "lookaround assertions ((?=, (?!, (?<=, (?<!) are not enforced")
    if isinstance(node.get("required"), list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        for name in node["required"]:
            if name not in props:
                raise _reject("required", path, f"required property {name!r} must also be declared in properties")
    _check_enum(node, path, root)


def _check_enum(node: dict, path: str, root: dict) -> None:
    # xgrammar writes exactly the enum/const values and ignores every sibling keyword; that is only
    # sound if each value satisfies those siblings.
    if "enum" not in node and "const" not in node:
        return
    siblings = _assertions(node, ("enum", "const"))
    if not siblings or not isinstance(node.get("enum", []), list):
        return
    values = node["enum"] if "enum" in node else [node["const"]]
    local = {k: root[k] for k in CONTAINERS if k in root} | {k: node[k] for k in siblings}
    if "enum" in node and "const" in node:
        local["const"] = node["const"]
    validator = Draft202012Validator(local)
    for v in values:
        err = next(iter(validator.iter_errors(v)), None)
        if err is not None:
            raise _reject(str(err.validator), path, f"value {json.dumps(v)} of the enum/const does not satisfy it "
                          f"({err.message}); only the enum/const values are enforced")


def check_schema(schema: dict) -> None:
    """Raise BadRequest unless `schema` is valid Draft 2020-12 and every construct is one we can honor."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise BadRequest(f"invalid JSON Schema at {e.json_path}: {e.message}", param="response_format") from None
    except RecursionError:
        raise BadRequest("the JSON Schema is nested too deeply", param="response_format") from None
    for node, path, types in _walk(schema):
        _check_node(node, path, types, schema)


def needs_validation(schema: dict) -> bool:
    """True when the grammar enforces some construct only approximately, so the finished output
    must be validated (Draft202012Validator with FORMAT_CHECKER) before it is returned."""
    for node, _, types in _walk(schema):
        if "oneOf" in node:
            return True
        if "string" not in types:
            continue
        has_format = node.get("format") in ENFORCED_FORMATS
        has_length = "minLength" in node or "maxLength" in node
        if has_format or ("pattern" in node and has_length):
            return True
    return False
