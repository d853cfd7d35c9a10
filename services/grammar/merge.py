"""The algebra normalize.py rewrites schemas with: JSON values and types as sets of kinds,
merging allOf parts into one schema (properties, required, bounds, enums intersected; a conflict
is Unsatisfiable), splitting if/then/else and dependent* into anyOf branches (the checks a merged
schema gets are in checks.py). Pure functions on schema dicts."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any


from radixflow.shared import patterns
from radixflow.shared.errors import BadRequest

MAX_DEPTH = 64            # schema levels; Draft202012Validator.check_schema gives out near 70
MAX_NODES = 50_000        # subschemas produced, every branch and inlined reference counted
MAX_CONDITIONALS = 4      # rewritten per object: 2^4 branches at most
MAX_INLINE = 16           # nested merges of $ref/allOf; deeper ones (long $ref chains) become $defs entries

FAMILIES: dict[str, tuple[str, ...]] = {
    "object": ("properties", "required", "additionalProperties", "unevaluatedProperties", "propertyNames",
               "minProperties", "maxProperties", "patternProperties", "dependentRequired", "dependentSchemas"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems", "contains",
              "minContains", "maxContains"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
KEY_FAMILY = {kw: fam for fam, kws in FAMILIES.items() for kw in kws}
# JSON types as sets of kinds: "number" is integers and fractions, so number & integer = integer
_KINDS = {"number": frozenset({"integer", "fraction"}), "integer": frozenset({"integer"})}
FAMILY_KINDS = {"object": frozenset({"object"}), "array": frozenset({"array"}), "string": frozenset({"string"}),
                "number": _KINDS["number"]}
ALL_KINDS = frozenset({"object", "array", "string", "integer", "fraction", "boolean", "null"})
_TYPE_ORDER = ("object", "array", "string", "number", "integer", "boolean", "null")
KEYWORDS = frozenset({"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
                      *KEY_FAMILY})
UNEVALUATED = ("unevaluatedProperties", "unevaluatedItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
SUBSCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
                 "contains", "not", "if", "then", "else")
SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
NEGATIVE = frozenset({"not", "if", "contains", "oneOf"})   # narrowing beneath these would widen
_IDENT = re.compile(r"[A-Za-z_$][\w$-]*")


class Unsupported(BadRequest):
    """A schema this normalizer cannot rewrite for xgrammar ($dynamicRef, a reference outside the
    schema, an $id below the root, too many subschemas once expanded), though it may be valid and
    satisfiable: a 400 for xgrammar, while llguidance, which reads such schemas itself, may serve it
    (the output is validated against the schema as sent). Invalid and unsatisfiable schemas are
    plain BadRequests: no engine serves them."""


class TooLarge(Unsupported):
    """The schema expands past MAX_NODES subschemas when normalized exactly."""


class Unsatisfiable(Exception):
    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def child_path(path: str, key: str | int) -> str:
    """JSONPath-style name of a subschema, as error messages show it."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if _IDENT.fullmatch(key) else f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def subschemas(node: dict) -> Iterator[tuple[str, str | int | None, Any]]:
    """(keyword, name or index or None, subschema) for every schema directly inside `node`."""
    for kw in SUBSCHEMA_MAPS:
        if isinstance(node.get(kw), dict):
            yield from ((kw, k, v) for k, v in node[kw].items())
    for kw in SUBSCHEMA_ONE:
        if kw in node:
            yield kw, None, node[kw]
    for kw in SUBSCHEMA_LISTS:
        if isinstance(node.get(kw), list):
            yield from ((kw, i, v) for i, v in enumerate(node[kw]))


# ---------------------------------------------------------------- values and types


def _canon(v: Any) -> Any:
    # JSON Schema equality: 1 == 1.0, but true != 1 and key order does not matter
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_canon(x) for x in v]
    if isinstance(v, dict):
        return {k: _canon(x) for k, x in v.items()}
    return v


def _key(v: Any) -> str:
    return json.dumps(_canon(v), sort_keys=True)


def _kinds(t: Any) -> frozenset[str] | None:
    if t is None:
        return None
    names = [t] if isinstance(t, str) else t
    return frozenset().union(*(_KINDS.get(n, frozenset({n})) for n in names))


def _value_kinds(values: list) -> frozenset[str]:
    def kind(v: Any) -> str:
        if isinstance(v, bool):
            return "boolean"
        if isinstance(v, (int, float)):
            return "integer" if float(v).is_integer() else "fraction"
        return {dict: "object", list: "array", str: "string"}.get(type(v), "null")
    return frozenset(kind(v) for v in values)


def _type_json(kinds: frozenset[str]) -> str | list[str]:
    # a lone "fraction" cannot be spelled; it never occurs (bounds remove integers and fractions together)
    number = "number" if "fraction" in kinds else "integer" if "integer" in kinds else None
    names = [t for t in _TYPE_ORDER if t == number or (t in kinds and t not in ("number", "integer"))]
    return names[0] if len(names) == 1 else names


def _all(a: Any, b: Any) -> Any:
    """a and b, as one raw schema."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    left = a["allOf"] if set(a) == {"allOf"} else [a]
    return {"allOf": [*left, b]}


def _all_list(schemas: list) -> Any:
    out: Any = True
    for s in schemas:
        out = _all(out, s)
    return out


def _search(pattern: str, name: str) -> bool:
    """A caller's pattern on a name of its schema: budgeted (a PatternTimeout propagates)."""
    try:
        return patterns.search(pattern, name) is not None
    except re.error:   # an ECMA-only pattern: assume no match, which can only narrow
        return False


def _enum_union(branches: Any, one: bool) -> list | None:
    """The values an anyOf (one=False) or oneOf (one=True) of branches that only list values
    (enum, const, annotations) accepts: for oneOf, those in exactly one branch. None when some
    branch asserts anything else."""
    if not isinstance(branches, list) or not branches:
        return None
    seen: dict[str, tuple[Any, int]] = {}
    for b in branches:
        if not isinstance(b, dict):
            return None
        asserts = {k for k in b if k in KEYWORDS}
        if not asserts or not asserts <= {"enum", "const"} or not isinstance(b.get("enum", []), list):
            return None
        vals = b["enum"] if "enum" in b else [b["const"]]
        if "enum" in b and "const" in b:
            vals = [v for v in vals if _key(v) == _key(b["const"])]
        for v in {_key(v): v for v in vals}.values():
            k = _key(v)
            seen[k] = (v, seen[k][1] + 1 if k in seen else 1)
    return [v for v, n in seen.values() if n == 1 or not one]


def _strip(node: dict) -> dict:
    """The keywords that assert something, const read as a one-value enum and draft-7
    `dependencies` as dependentRequired/dependentSchemas."""
    if "$dynamicRef" in node or "$recursiveRef" in node:
        raise Unsupported("$dynamicRef and $recursiveRef are not supported", param="response_format")
    out = {k: v for k, v in node.items() if k in KEYWORDS}
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for key, dep in deps.items():
            if isinstance(dep, list):
                req = out["dependentRequired"] = dict(out.get("dependentRequired", {}))
                req[key] = list(dict.fromkeys([*req.get(key, []), *dep]))
            else:
                ds = out["dependentSchemas"] = dict(out.get("dependentSchemas", {}))
                ds[key] = _all(ds.get(key, True), dep)
    if "const" in out:
        c = out.pop("const")
        out["enum"] = [v for v in out.get("enum", [c]) if _key(v) == _key(c)]
    for comb in ("anyOf", "oneOf"):
        values = _enum_union(out.get(comb), comb == "oneOf")
        if values is not None:
            # branches that are only enums (a list of tool names, each with its description) are one
            # enum: merged into a sibling pattern or enum it is one filter, where distributing the
            # sibling into every branch makes a node per branch at every use
            out.pop(comb)
            out["enum"] = values if "enum" not in out else [v for v in out["enum"] if _key(v) in {_key(u) for u in values}]
    if "if" not in out or ("then" not in out and "else" not in out):
        for k in ("if", "then", "else"):
            out.pop(k, None)
    if "contains" not in out:
        out.pop("minContains", None)
        out.pop("maxContains", None)
    return out


def _applicators(s: dict) -> bool:
    # keywords whose subschemas mark properties/items evaluated for unevaluated* in the same schema
    return any(k in s for k in ("allOf", "anyOf", "oneOf", "if", "dependentSchemas", "$ref")) or (
        "unevaluatedItems" in s and "contains" in s)


def _localize(s: dict) -> dict:
    """unevaluated* of a schema without applicators is additionalProperties/items."""
    s = dict(s)
    for u, local in zip(UNEVALUATED, ("additionalProperties", "items")):
        if u in s:
            v = s.pop(u)
            s.setdefault(local, v)
    return s


# ---------------------------------------------------------------- merging allOf parts

_MERGED_BELOW = frozenset({"properties", "patternProperties", "additionalProperties", "prefixItems", "items",
                           "then", "else", "contains", "minContains", "maxContains"})


def _merge(parts: list[dict], rest: list) -> tuple[dict, list[dict]]:
    """One schema for the conjunction of `parts` (plus (if, then, else) conditionals); parts and
    keywords that cannot be combined exactly are appended to `rest`, to stay an allOf."""
    m: dict = {}
    conds: list[dict] = []
    kept: list[dict] = []
    for p in parts:
        # a part's additionalProperties skips its own patternProperties' keys, which a merged
        # schema cannot say when another part brings the patterns
        if kept and (("patternProperties" in p and any("additionalProperties" in o for o in kept)) or
                     ("additionalProperties" in p and any("patternProperties" in o for o in kept))):
            rest.append(p)
            continue
        kept.append(p)
        for k, v in p.items():
            if k in _MERGED_BELOW:
                continue
            if k == "if":
                conds.append({x: p[x] for x in ("if", "then", "else") if x in p})
            elif k in ("anyOf", "oneOf"):
                if "anyOf" in m or "oneOf" in m:
                    rest.append({k: v})
                else:
                    m[k] = v
            elif k not in m:
                m[k] = v
            else:
                _merge_keyword(m, k, v, rest)
        if "contains" in p:
            group = {k: p[k] for k in ("contains", "minContains", "maxContains") if k in p}
            if "contains" in m:
                rest.append(group)
            else:
                m.update(group)
    _merge_objects(m, kept)
    _merge_arrays(m, kept)
    return m, conds


def _merge_keyword(m: dict, k: str, v: Any, rest: list) -> None:
    old = m[k]
    if k == "type":
        kinds = _kinds(old) & _kinds(v)
        m[k] = _type_json(kinds) if kinds else []   # empty: unsatisfiable, found in _finish
    elif k == "enum":
        keys = {_key(x) for x in v}
        m[k] = [x for x in old if _key(x) in keys]
    elif k in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
        m[k] = max(old, v)
    elif k in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
        m[k] = min(old, v)
    elif k == "uniqueItems":
        m[k] = old or v
    elif k == "required":
        m[k] = list(dict.fromkeys([*old, *v]))
    elif k == "not":
        m[k] = {"anyOf": [old, v]}                         # not A and not B = not (A or B)
    elif k == "propertyNames":
        m[k] = _all(old, v)
    elif k == "dependentRequired":
        m[k] = {**old, **{n: list(dict.fromkeys([*old.get(n, []), *r])) for n, r in v.items()}}
    elif k == "dependentSchemas":
        m[k] = {**old, **{n: _all(old.get(n, True), s) for n, s in v.items()}}
    elif k == "multipleOf" and isinstance(old, int) and isinstance(v, int):
        m[k] = old * v // math.gcd(old, v)
    elif _key(old) != _key(v):                             # pattern, format, multipleOf: both must hold
        rest.append({k: v})


def _merge_objects(m: dict, parts: list[dict]) -> None:
    names = list(dict.fromkeys(n for p in parts for n in p.get("properties", {})))
    if names:
        props = {}
        for name in names:
            subs = []
            for p in parts:
                if name in p.get("properties", {}):
                    subs.append(p["properties"][name])
                elif "additionalProperties" in p and not any(_search(pat, name) for pat in p.get("patternProperties", {})):
                    subs.append(p["additionalProperties"])
            props[name] = _all_list(subs)
        m["properties"] = props
    patterns: dict = {}
    for p in parts:
        for pat, s in p.get("patternProperties", {}).items():
            patterns[pat] = _all(patterns.get(pat, True), s)
    if patterns:
        m["patternProperties"] = patterns
    extra = [p["additionalProperties"] for p in parts if "additionalProperties" in p]
    if extra:
        m["additionalProperties"] = _all_list(extra)


def _merge_arrays(m: dict, parts: list[dict]) -> None:
    width = max((len(p.get("prefixItems", [])) for p in parts), default=0)
    prefix = []
    for i in range(width):
        subs = []
        for p in parts:
            own = p.get("prefixItems", [])
            if i < len(own):
                subs.append(own[i])
            elif "items" in p:
                subs.append(p["items"])
        prefix.append(_all_list(subs))
    if prefix:
        m["prefixItems"] = prefix
    items = [p["items"] for p in parts if "items" in p]
    if items:
        m["items"] = _all_list(items)


# ---------------------------------------------------------------- conditionals


def _split_if(ite: dict, path: str) -> list[tuple[str, Any]] | None:
    """anyOf branches equal to if/then/else, or None when `if` tests more than properties."""
    cond, then, other = ite["if"], ite.get("then", True), ite.get("else", True)
    if cond is True or cond is False:
        return [(child_path(path, "then"), then)] if cond else [(child_path(path, "else"), other)]
    c = _strip(cond)
    if set(c) - {"properties", "required", "type"} or c.get("type", "object") != "object":
        return None
    props, required = c.get("properties", {}), c.get("required", [])
    negations: list[dict] = []
    if "type" in c:
        negations.append({"type": _type_json(ALL_KINDS - {"object"})})
    for name in dict.fromkeys([*props, *required]):
        s = props.get(name, True)
        if s is not True and s != {}:
            negations.append({"type": "object", "required": [name], "properties": {name: {"not": s}}})
        if name in required:
            negations.append({"type": "object", "properties": {name: False}})
    branches = [(child_path(path, "then"), _all(cond, then))]
    return branches + [(child_path(path, "else"), _all(n, other)) for n in negations]


def _split_dependent(m: dict, path: str) -> list[tuple[str, Any]] | None:
    for kw in ("dependentRequired", "dependentSchemas"):
        if m.get(kw):
            deps = dict(m[kw])
            key, dep = next(iter(deps.items()))
            del deps[key]
            if deps:
                m[kw] = deps
            else:
                del m[kw]
            present = {"required": [key, *dep]} if kw == "dependentRequired" else _all({"required": [key]}, dep)
            label = child_path(child_path(path, kw), key)
            return [(label, {"properties": {key: False}}), (label, present)]
    return None
