"""The honest guarantee: which JSON Schema (Draft 2020-12) constructs the grammar enforces.

xgrammar 0.2.9 compiles a schema into a grammar, but it silently drops or weakens some keywords
(sometimes with a stderr warning, often without). Each row below was measured against the
installed xgrammar by comparing what the grammar accepts with what jsonschema accepts
(any_whitespace, max_whitespace_cnt=2, strict_mode). `prepare(schema)` first rewrites the schema
(normalize.py: same meaning, constraints moved to where a grammar reads them), then relaxes what
no grammar enforces.

| Construct | Status |
|---|---|
| `type` (all seven, and lists such as `["string","null"]`) | enforced |
| `enum`, `const` | enforced (values are written in compact JSON; values failing the keywords beside them are dropped) |
| `minLength`, `maxLength` (code points) | enforced |
| `pattern` | enforced; lookaround `(?=` `(?!` `(?<=` `(?<!`: checked (the grammar gets the pattern without them); backreferences, `\\b`, `\\p{..}` are compile errors; what xgrammar warns it ignores (`^`/`$` mid-pattern, an escape it reads literally): checked |
| `format`: date, time, date-time, duration, email, hostname, ipv4, ipv6, uri, uri-reference, uri-template, json-pointer, relative-json-pointer, uuid | approximate (xgrammar's regexes, e.g. 2024-02-30 passes): checked |
| `format`: regex, iri, iri-reference, idn-email, idn-hostname | checked (not enforced at all) |
| `format`: any other (custom) value | annotation only, as Draft 2020-12 defines |
| `pattern`/`format` combined with `minLength`/`maxLength`, or `format` with `pattern` | approximate (only the pattern/format is enforced): checked |
| `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` | enforced (integer bounds are rounded to whole numbers) |
| `multipleOf` on `integer` | enforced |
| `multipleOf` on `number` | checked (ignored by xgrammar) |
| `items`, `prefixItems`, `minItems`, `maxItems`, `unevaluatedItems` | enforced |
| `uniqueItems: true` | checked (ignored) |
| `contains`, `minContains`, `maxContains` | checked (ignored) |
| `properties`, `additionalProperties` (bool or schema), `unevaluatedProperties`, `propertyNames`, `minProperties`, `maxProperties` | enforced; `unevaluatedProperties` beside `anyOf`/`oneOf`: checked |
| `required` | enforced; a required name missing from `properties` is declared there |
| `patternProperties` | checked (matching keys are written only through `properties`/`additionalProperties`) |
| `dependentRequired`, `dependentSchemas` (and draft-7 `dependencies`) | enforced (rewritten to `anyOf`, up to 4 conditionals per object); more: checked |
| `anyOf` | enforced (keywords beside it are merged into every branch) |
| `oneOf` | enforced when its branches are provably disjoint (rewritten to `anyOf`); else approximate: checked |
| `allOf` | enforced (merged into one schema); parts that cannot be merged (two patterns, formats or `contains`): checked |
| `if`/`then`/`else` | enforced when `if` only tests properties (rewritten to `anyOf`); else checked (ignored) |
| `not` | beside an `enum` (also from `if`/`then`/`else`): enforced (the values are removed); else checked (ignored) |
| `$ref` to `#`, `#/...` or `#anchor` (recursion included), `$defs`, `definitions`, keywords beside `$ref` | enforced |
| `$ref` to anything else (remote, relative to `$id`), `$dynamicRef`, `$recursiveRef`, `$id` below the root | rejected (400, merge.Unsupported: `auto` hands the schema to llguidance, checked) |
| type-specific keywords (e.g. `maxLength`, `minimum`, `required`, `maxItems`) without `type` | the type their keywords name is added (narrowing); beneath `not`/`if`/`contains`/`oneOf`: checked |
| an unsatisfiable schema (e.g. allOf parts with no type in common, minimum > maximum, disjoint enums) | rejected (400, naming the path) |
| `title`, `description`, `default`, `examples`, `deprecated`, `readOnly`, `writeOnly`, `$comment`, `$schema`, `$anchor`, `content*`, `x-*`, any unknown keyword | annotations (dropped) |

Narrowing (valid output, but not every valid document can be produced): properties come in
declared order; an object that declares `properties` or an array that declares `prefixItems`
takes nothing beyond them unless `additionalProperties`/`items` says so (strict mode); integers
have no fraction or exponent; numbers have no exponent when bounded; enum/const values are
written compactly; a length-bounded string cannot contain escapes (`\\n`, `\\"`, `\\uXXXX`);
whitespace between tokens is at most 2 characters; a schema without `type` produces only the
types its keywords name.

Beyond xgrammar: its length-bounded strings admit raw control characters (invalid JSON); the
compile worker patches that class (see backends/xgrammar.py). Any other warning xgrammar
prints while compiling makes the request "checked" (compiler._VALIDATED_WARNINGS lists the
three that needs_validation foresees); for a regex or EBNF, which nothing validates, a 400.
In strict mode xgrammar refuses an array (object) without `items` (`additionalProperties`) whose
minItems (minProperties) asks for more than it declares: absent means anything, which the
prepared schema then writes out.

"checked": the grammar enforces everything else (the construct is removed from the schema it
compiles, which only widens it), `prepare` reports the enforcement level "checked", and the
finished output is validated against the ORIGINAL schema (Draft202012Validator with its format
checker) and resampled when it fails. needs_validation(schema) marks the approximations.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any



from radixflow.shared.errors import BadRequest

from .drafts import id_keyword, to_2020
from .merge import Unsupported
from .normalize import child_path, subschemas, widened
from .resources import localize

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

# what no grammar enforces: removed from the schema the grammar compiles, checked on the output
UNENFORCED = ("not", "uniqueItems", "contains", "minContains", "maxContains", "if", "then", "else",
              "dependentRequired", "dependentSchemas", "patternProperties", "allOf")
ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer", "uuid"})
UNENFORCED_FORMATS = frozenset({"regex", "iri", "iri-reference", "idn-email", "idn-hostname"})
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _without_lookarounds(pattern: str) -> str | None:
    """`pattern` minus its lookaround groups, which only ever restrict a match (so the result
    accepts more); None where that is not so simple (a quantified lookaround, unbalanced text)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class or ch == "[" or ch == "]":
            in_class = (in_class or ch == "[") and not (in_class and ch == "]")
        elif _LOOKAROUND.match(pattern, i):
            depth, j, cls = 0, i, False
            while j < len(pattern):
                c = pattern[j]
                if c == "\\":
                    j += 2
                    continue
                if cls or c in "[]":
                    cls = (cls or c == "[") and not (cls and c == "]")
                elif c == "(":
                    depth += 1
                elif c == ")":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            if depth != 0 or pattern[j + 1:j + 2] in ("?", "*", "+", "{"):
                return None
            i = j + 1
            continue
        out.append(ch)
        i += 1
    wider = "".join(out)
    try:
        re.compile(wider)
    except re.error:
        return None
    return wider


def _without_assertions(pattern: str) -> str:
    """`pattern` minus the zero-width escapes \\A \\Z \\z \\b \\B \\G outside character classes
    (where \\b is a backspace): like a lookaround, each only restricts a match."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            if in_class or pattern[i + 1:i + 2] not in tuple("AZzbBG"):
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


_ASSERTION = re.compile(r"\\[AZzbBG]")
_LL_DATA = frozenset({"enum", "const", "default", "examples"})   # values, not schemas: left alone


def _ll_refuses(pattern: str) -> bool:
    return bool(_LOOKAROUND.search(pattern) or _ASSERTION.search(pattern))


def widen_for_llguidance(schema: Any) -> Any | None:
    """A copy of `schema` for llguidance where it refused `schema` itself, or None when nothing
    here would change it. Its regexes have no lookaround or zero-width escape (\\A, \\b, ...), so
    patterns and patternProperties keys lose them (or go, where that is not simple); it wants
    patternProperties provably disjoint, so several go; and it gives up intersecting a pattern
    with a long length bound ("Unable to determine if regex is empty"), so length bounds beside a
    pattern or format go. Each change widens the schema, except that the keys of a dropped
    patternProperties entry under a closed object are no longer written at all: either way the
    output is validated against `schema` itself (the compiler marks it checked). Everything below
    a keyword is visited, older drafts' keywords included: a "pattern" that is not one (say, inside
    an extension keyword) only changes a copy that no validator reads."""
    changed = False

    def widen(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, list):
            return [widen(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in _LL_DATA else widen(v)) for k, v in node.items()}
        pattern = out.get("pattern")
        if isinstance(pattern, str) and _ll_refuses(pattern):
            wider = _without_lookarounds(_without_assertions(pattern))
            if wider is None:
                del out["pattern"]
            else:
                out["pattern"] = wider
            changed = True
        props = out.get("patternProperties")
        if isinstance(props, dict) and len(props) > 1:
            # llguidance wants the key patterns provably disjoint ("^" and "^x-" are not): they go,
            # and their keys fall to additionalProperties as below
            del out["patternProperties"]
            changed = True
        elif isinstance(props, dict) and any(_ll_refuses(p) for p in props):
            # a key pattern that cannot be widened goes: its keys fall to additionalProperties
            # (allowed with any value, or not at all: both fine, the output is validated)
            wider_props: dict[str, Any] = {}
            for p, sub in props.items():
                wider = _without_lookarounds(_without_assertions(p)) if _ll_refuses(p) else p
                if wider is not None:
                    wider_props.setdefault(wider, sub)
            out["patternProperties"] = wider_props
            changed = True
        if isinstance(out.get("pattern"), str) or isinstance(out.get("format"), str):
            for bound in ("minLength", "maxLength"):
                if bound in out:
                    del out[bound]
                    changed = True
        return out

    try:
        wider = widen(schema)
    except RecursionError:     # deeper than anything drafts.check lets through; nothing to offer
        return None
    return wider if changed else None


def _walk(schema: Any) -> Iterator[tuple[dict, str, set[str]]]:
    """Every schema object in `schema` with its JSON path and the types it may take; iterative, so
    deep schemas cannot blow the stack. Children are read after the caller had the node."""
    stack: list[tuple[Any, str, set[str] | None]] = [(schema, "$", None)]
    while stack:
        node, path, implied = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, path, _types(node) or implied or set()
        for kw, key, sub in subschemas(node):
            p = child_path(path, kw) if key is None else child_path(child_path(path, kw), key)
            # property names are strings: xgrammar applies string keywords there without a type
            stack.append((sub, p, {"string"} if kw == "propertyNames" else None))


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _reject(name: str, path: str, why: str) -> Unsupported:
    return Unsupported(f"unsupported JSON Schema construct '{name}' at {path}: {why}", param="response_format")


def _check_servable(schema: dict) -> None:
    """400 for references we cannot follow (validity was checked by drafts.to_2020)."""
    for node, path, _ in _walk(schema):
        for kw in ("$dynamicRef", "$recursiveRef"):
            if kw in node:
                raise _reject(kw, path, "dynamic references are not supported; use $ref")
        if "$id" in node and node is not schema:
            raise _reject("$id", path, "only the root may set $id (references resolve against the root)")
        if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"):
            raise _reject("$ref", path, "only references within the schema ('#', '#/...', '#anchor') are "
                          f"supported, got {node['$ref']!r}")
        _check_ref_cycle(schema, node, path)


_ANNOTATIONS = {"$ref", "title", "description", "$comment", "default", "examples", "deprecated", "readOnly",
                "writeOnly"}


def _check_ref_cycle(root: dict, node: dict, path: str) -> None:
    """A schema that is only a reference to a schema that is only a reference ... back to itself
    ({"$ref": "#"} at the root) describes nothing: no value is ever produced by it. 400, instead of
    a grammar that accepts no text or anything."""
    seen = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and set(node) <= _ANNOTATIONS:
        ref = node["$ref"]
        if not (ref == "#" or ref.startswith("#/")):
            return                      # an anchor: normalize resolves it, and checks it
        if ref in seen:
            raise BadRequest(f"the $ref {ref!r} at {path} only refers back to itself: no value satisfies it",
                             param="response_format")
        seen.add(ref)
        node = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return                  # does not resolve: normalize says so


def _relax(schema: dict) -> bool:
    """Remove in place what the grammar would not enforce; True when anything was removed."""
    relaxed = False
    for node, _, types in _walk(schema):
        dropped = [k for k in UNENFORCED if k in node]
        if "anyOf" in node or "oneOf" in node:   # xgrammar ignores keywords beside them
            dropped += [k for k in node if k not in ("anyOf", "oneOf") and k not in CONTAINERS]
        if node.get("format") in UNENFORCED_FORMATS:
            dropped.append("format")
        if isinstance(node.get("pattern"), str) and _LOOKAROUND.search(node["pattern"]):
            relaxed = True
            if (wider := _without_lookarounds(node["pattern"])) is not None:
                node["pattern"] = wider
            else:
                dropped.append("pattern")
        if "multipleOf" in node and ("number" in types or "integer" not in types):
            dropped.append("multipleOf")
        dropped += [k for k in node if k in FAMILY and not types & FAMILY[k]]
        for k in dict.fromkeys(dropped):
            value = node.pop(k)
            relaxed |= not (k == "uniqueItems" and value is False)
        props = node.get("properties")
        if isinstance(props, dict) and False in props.values():
            # "must be absent": strict mode writes no undeclared key unless these allow one
            node["properties"] = {k: v for k, v in props.items() if v is not False}
            relaxed |= node.get("additionalProperties", False) is not False or (
                node.get("unevaluatedProperties", False) is not False)
        if isinstance(node.get("required"), list):
            declared = node.get("properties", {})
            if any(n not in declared for n in node["required"]):
                node["required"] = [n for n in node["required"] if n in declared]
                relaxed = True
        relaxed |= _open_for_minimum(node)
    return relaxed


def _open_for_minimum(node: dict) -> bool:
    """xgrammar's strict mode closes an object (array) that declares no additionalProperties
    (items), and then refuses one that must hold more than it declares (minProperties, minItems
    over what properties, prefixItems give: "minItems is greater than the number of prefixItems,
    but additional items are not allowed"). Absent means "anything" in JSON Schema: it is written
    out. A closed object whose patternProperties were dropped above is opened too (widening: the
    output is checked). True when that widened the schema."""
    widened = False
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items > len(node.get("prefixItems", [])) and "items" not in node \
            and "unevaluatedItems" not in node:
        node["items"] = {}
    min_props = node.get("minProperties")
    if isinstance(min_props, int) and min_props > len(node.get("properties", {})) \
            and node.get("additionalProperties", False) is False and "unevaluatedProperties" not in node:
        widened = "additionalProperties" in node
        node["additionalProperties"] = {}
    return widened


def prepare(schema: dict, checked: bool = False) -> tuple[dict, str]:
    """(the schema to compile, the enforcement level). The schema is `schema` normalized, then
    relaxed where no grammar enforces it (so it only widens there); the level is "full" when the
    grammar enforces all of the normalized schema, and "checked" when the finished output must be
    validated against `schema` (and resampled when it fails). BadRequest (400) for a schema that
    can never be served (see the table above); merge.Unsupported (a 400 too) for one that only
    xgrammar cannot be given. `checked`: drafts.check already passed, skip it (the slow part)."""
    # references into the document's embedded resources as pointers (resources.py), then a Draft
    # 4 / 6 / 7 / 2019-09 schema as 2020-12 (drafts.py)
    schema = to_2020(localize(schema, id_keyword(schema)), checked)
    _check_servable(schema)
    prepared, wider = widened(schema)
    relaxed = _relax(prepared)
    return prepared, "checked" if wider or relaxed or needs_validation(prepared) else "full"


def check_schema(schema: dict) -> None:
    """Raise BadRequest unless `schema` is valid Draft 2020-12 and can be served (see prepare)."""
    prepare(schema)


def bounded_formats(schema: Any) -> bool:
    """True when a string schema bounds the length of a `format` or `pattern`: xgrammar enforces
    only the format/pattern there (the length is checked after), llguidance enforces both."""
    return any(("format" in node or "pattern" in node) and ("minLength" in node or "maxLength" in node)
               for node, _, _ in _walk(schema))


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
