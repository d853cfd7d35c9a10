"""normalize(schema): a JSON Schema (Draft 2020-12) rewritten into the shape a grammar compiler
reads, with the same meaning.

xgrammar reads a schema node by node: it ignores keywords beside `$ref`, `anyOf` and `oneOf`,
every `allOf` part after the first, `if`/`then`/`else`, and type keywords without `type`. Real
schemas use all of these, so their constraints are moved to where a grammar sees them.

Each rule keeps the set of valid instances EXACTLY, except those marked NARROWS: every instance
valid under the result is then valid under the input, never the reverse.

  annotations    title, description, examples, default, deprecated, readOnly, writeOnly,
                 $comment, x-*, and any keyword Draft 2020-12 does not define: dropped      exact
  $ref           stays a reference, so recursion stays recursion; a target outside the root's
                 $defs/definitions is copied into $defs. Keywords beside it are merged with
                 the target as an allOf                                                     exact
  allOf          merged into one schema: properties recursively, each part's
                 additionalProperties applied to the other parts' properties, required
                 unioned, types, enums and bounds intersected. What cannot be merged (two
                 patterns, formats or `contains`) stays in an allOf of the rest             exact
  anyOf, oneOf   keywords beside them merged into every branch; unsatisfiable branches
                 dropped; a oneOf whose branches are provably disjoint (types, enums, or a
                 required property with disjoint enums) becomes an anyOf                    exact
  if/then/else   when `if` only tests properties (properties, required, type object):
                 anyOf[if+then, not-if+else], not-if spelled per property as "present and
                 not S" or "absent" (properties: {p: false}); `not` beside an enum becomes the
                 enum minus those values (see enum)                                          exact
  dependentRequired, dependentSchemas: anyOf["key absent", "key present and ..."]           exact
  dependencies   (draft 7, not a 2020-12 keyword) read as dependentRequired/Schemas       NARROWS
  enum, const    values failing the keywords beside them dropped, and those keywords      exact
  required       a required name missing from properties is declared with the schema
                 additionalProperties gives it                                              exact
  integer bounds rounded to whole numbers (minimum 0.5 -> 1), exclusive made inclusive      exact
  unsatisfiable  an optional property becomes false (absent), a branch is dropped, a type
                 whose bounds conflict leaves `type`; when nothing is left: 400 naming the path
  no `type`      keywords of one type family (object, array, string, number) add that type;
                 of several, `type` lists them (each keyword binds only its own type). Not
                 inside `not`, `if`, `contains` or `oneOf`, where narrowing would widen     NARROWS

Bounded, not recursive through references: each $defs entry is normalized once, from a queue; a
$ref merged with keywords beside it is inlined, unless it recurs within itself or lies under 16
such merges (then it becomes a $defs entry too). Past 64 schema levels or 50,000 produced
subschemas the schema is refused (400); more than 4 conditionals on one object are left as they
are (lint.prepare: checked, not enforced).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from jsonschema import Draft202012Validator

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


def normalize(schema: dict) -> dict:
    """`schema` rewritten by the rules above; BadRequest (400) when it is unsatisfiable, refers to
    anything but itself, or is too deep or too large. Expects a schema that passed
    Draft202012Validator.check_schema."""
    try:
        return _Normalizer(schema).run()
    except Unsatisfiable as e:
        raise BadRequest(f"the JSON Schema is unsatisfiable at {e.path}: {e.why}", param="response_format") from None


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
    try:
        return re.search(pattern, name) is not None
    except re.error:   # an ECMA-only pattern: assume no match, which can only narrow
        return False


def _strip(node: dict) -> dict:
    """The keywords that assert something, const read as a one-value enum and draft-7
    `dependencies` as dependentRequired/dependentSchemas."""
    if "$dynamicRef" in node or "$recursiveRef" in node:
        raise BadRequest("$dynamicRef and $recursiveRef are not supported", param="response_format")
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


# ---------------------------------------------------------------- the walk


class _Normalizer:
    def __init__(self, root: dict):
        self.root = root
        self.validator = Draft202012Validator(root, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self.anchors = self._anchors()
        self.defs: dict[str, dict] = {"$defs": {}, "definitions": {}}
        self.units: dict[str, str] = {}          # JSON pointer, or a merged node's key -> output $ref
        self.queue: list[tuple[str, str, Any, str]] = []   # (container, name, raw schema, path)
        self.active: set[str] = set()            # merged nodes being normalized, for recursion
        self.nodes = 0

    def run(self) -> dict:
        out = self.norm(self.root, "$", 0)
        while self.queue:
            container, name, raw, path = self.queue.pop()
            self.defs[container][name] = self.norm(raw, path, 0)
        out.update({c: entries for c, entries in self.defs.items() if entries})
        _infer_types(out)
        return out

    def _unit(self, key: str, raw: Any, path: str, container: str = "$defs", name: str = "") -> str:
        """The output $ref of an entry normalized once, from the queue (never recursively)."""
        ref = self.units.get(key)
        if ref is None:
            if not name:
                taken = set(self.root.get("$defs", {})) | set(self.defs["$defs"]) | {
                    r.rsplit("/", 1)[1] for r in self.units.values() if r.startswith("#/$defs/")}
                name = next(f"ref{i}" for i in range(len(taken) + 1) if f"ref{i}" not in taken)
            ref = self.units[key] = f"#/{container}/" + name.replace("~", "~0").replace("/", "~1")
            self.queue.append((container, name, raw, path))
        return ref

    # ---- references

    def _anchors(self) -> dict[str, str]:
        found, stack = {}, [(self.root, "")]
        while stack:
            node, pointer = stack.pop()
            if not isinstance(node, dict):
                continue
            for kw in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(kw), str):
                    found.setdefault(node[kw], pointer)
            for kw, key, sub in subschemas(node):
                tail = "" if key is None else "/" + str(key).replace("~", "~0").replace("/", "~1")
                stack.append((sub, f"{pointer}/{kw}{tail}"))
        return found

    def _pointer(self, ref: str, path: str) -> str:
        if ref == "#" or ref.startswith("#/"):
            return unquote(ref[1:])
        if ref.startswith("#") and ref[1:] in self.anchors:
            return self.anchors[ref[1:]]
        raise BadRequest(f"unsupported JSON Schema construct '$ref' at {path}: only references within the schema "
                         f"('#', '#/...', '#anchor') are supported, got {ref!r}", param="response_format")

    def _deref(self, pointer: str, ref: str, path: str) -> tuple[Any, str]:
        node, where = self.root, "$"
        for part in pointer.split("/")[1:] if pointer else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node, where = node[int(part)], child_path(where, int(part))
            elif isinstance(node, dict) and part in node:
                node, where = node[part], child_path(where, part)
            else:
                raise BadRequest(f"the $ref {ref!r} at {path} does not resolve", param="response_format")
        return node, where

    def _ref(self, ref: str, path: str) -> str:
        """The output reference for `ref`; a target outside the root's $defs/definitions (say
        #/properties/a) gets an entry of its own."""
        pointer = self._pointer(ref, path)
        target, where = self._deref(pointer, ref, path)
        if not pointer:
            return "#"
        parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        if len(parts) == 2 and parts[0] in self.defs:
            return self._unit(pointer, target, where, parts[0], parts[1])
        return self._unit(pointer, target, where)

    # ---- one schema

    def child(self, node: Any, path: str, depth: int) -> Any:
        """A subschema that may be unsatisfiable without making its parent so: then False."""
        try:
            return self.norm(node, path, depth)
        except Unsatisfiable:
            return False

    def norm(self, node: Any, path: str, depth: int) -> dict:
        if depth > MAX_DEPTH:
            raise BadRequest(f"the JSON Schema is nested too deeply at {path} (over {MAX_DEPTH} levels)",
                             param="response_format")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise BadRequest(f"the JSON Schema expands to over {MAX_NODES} subschemas once its allOf, $ref and "
                             "if/then/else are resolved; simplify it", param="response_format")
        if node is True:
            return {}
        if node is False:
            raise Unsatisfiable(path, "the schema is false")
        node = _strip(node)
        if set(node) == {"$ref"}:
            return {"$ref": self._ref(node["$ref"], path)}
        if set(node) == {"allOf"} and len(node["allOf"]) == 1:
            return self.norm(node["allOf"][0], path, depth)
        if "$ref" not in node and "allOf" not in node:
            return self._norm_merged(node, path, depth)
        # references get inlined here: met again while inlined, the node is recursive and becomes
        # a $defs entry (its $refs are absolute, so equal text means an equal schema anywhere), as
        # does one under too many inlines (a long chain of $refs with keywords beside them)
        key = _key(node)
        if key in self.active or len(self.active) >= MAX_INLINE:
            return {"$ref": self._unit(key, node, path)}
        self.active.add(key)
        try:
            return self._norm_merged(node, path, depth)
        finally:
            self.active.discard(key)

    def _norm_merged(self, node: dict, path: str, depth: int) -> dict:
        parts, rest, top_unevaluated = self._flatten(node, path)
        m, conds = _merge(parts, rest)
        m.update(top_unevaluated)
        if "enum" in m:
            return self._enum(m, rest, conds, path)
        comb = "anyOf" if "anyOf" in m else "oneOf" if "oneOf" in m else None
        if comb:
            branches = [(child_path(child_path(path, comb), i), b) for i, b in enumerate(m.pop(comb))]
        elif 0 < len(conds) + len(m.get("dependentRequired", {})) + len(m.get("dependentSchemas", {})) <= MAX_CONDITIONALS:
            comb, branches = "anyOf", None
            for i, ite in enumerate(conds):
                branches = _split_if(ite, path)
                if branches is not None:
                    del conds[i]
                    break
            branches = branches or _split_dependent(m, path)
            if branches is None:
                comb = None
        if comb:
            return self._distribute(m, comb, branches, rest + conds, path, depth)
        return self._finish(m, rest, conds, path, depth)

    def _flatten(self, node: dict, path: str) -> tuple[list[dict], list, dict]:
        """The allOf parts of `node` (its $ref targets included), each without allOf or $ref, the
        parts that must stay whole, and the node's own unevaluated* (which sees every part)."""
        top_unevaluated = {k: node[k] for k in UNEVALUATED if k in node}
        parts: list[dict] = []
        rest: list = []
        seen: set[str] = set()
        stack: list[tuple[Any, bool]] = [({k: v for k, v in node.items() if k not in UNEVALUATED}, True)]
        while stack:
            s, top = stack.pop()
            if s is True:
                continue
            if s is False:
                raise Unsatisfiable(path, "an allOf part is false")
            if not top:
                s = _strip(s)
                if any(k in s for k in UNEVALUATED):
                    if _applicators(s):   # its unevaluated* sees its own applicators only
                        rest.append(s)
                        continue
                    s = _localize(s)
            if "$ref" in s:
                s = dict(s)
                pointer = self._pointer(s.pop("$ref"), path)
                stack.append((s, top))
                if pointer not in seen:   # A and A is A: a reference cycle adds nothing
                    seen.add(pointer)
                    stack.append((self._deref(pointer, "#" + pointer, path)[0], False))
                continue
            if "allOf" in s:
                s = dict(s)
                stack.extend((sub, False) for sub in reversed(s.pop("allOf")))
                stack.append((s, top))
                continue
            parts.append(s)
        return parts, rest, top_unevaluated

    def _enum(self, m: dict, rest: list, conds: list, path: str) -> dict:
        values = m.pop("enum")
        others = dict(m)
        if rest or conds:
            others["allOf"] = rest + conds
        if others:
            v = self.validator.evolve(schema=others)
            values = [x for x in values if _valid(v, x)]
        if not values:
            raise Unsatisfiable(path, "no value of the enum/const satisfies the keywords beside it")
        return {"enum": values}

    def _distribute(self, m: dict, comb: str, branches: list, rest: list, path: str, depth: int) -> dict:
        # unevaluated* stays beside the combinator: it sees the properties of every valid branch
        keep = {k: m.pop(k) for k in UNEVALUATED if k in m}
        out, last = [], None
        for label, b in branches:
            parts = [x for x in (m, *rest, b) if x != {}]
            try:
                nb = self.norm({"allOf": parts}, label, depth + 1)
            except Unsatisfiable as e:
                last = e
                continue
            out.extend(nb["anyOf"] if comb == "anyOf" and set(nb) == {"anyOf"} else [nb])
        if not out:
            raise Unsatisfiable(path, f"no branch of {comb} can be satisfied ({last.path}: {last.why})")
        if comb == "oneOf" and all(_disjoint(a, b) for i, a in enumerate(out) for b in out[i + 1:]):
            comb = "anyOf"
        if len(out) == 1 and not keep:
            return out[0]
        result = {comb: out}
        result.update({k: self.child(v, child_path(path, k), depth + 1) for k, v in keep.items()})
        return result

    def _finish(self, m: dict, rest: list, conds: list, path: str, depth: int) -> dict:
        kinds = _kinds(m.get("type"))
        if kinds is not None:
            if not kinds:
                raise Unsatisfiable(path, "the allowed types have nothing in common")
            for k in [k for k in m if k in KEY_FAMILY and not FAMILY_KINDS[KEY_FAMILY[k]] & kinds]:
                del m[k]                  # binds a type the schema excludes: inert
        dead: dict[str, str] = {}         # type family -> why no instance of it is valid
        _check_bounds(m, kinds, dead)
        if not rest and not conds and "dependentSchemas" not in m and not _applicators(m):
            m = _localize(m)
        required = m.get("required", [])
        if any(n not in m.get("properties", {}) for n in required):
            _declare_required(m, required, dead)
        out: dict = {}
        for k, v in m.items():
            p = child_path(path, k)
            if k == "properties":
                out[k] = {}
                for name, s in v.items():
                    if name in required:
                        try:
                            out[k][name] = self.norm(s, child_path(p, name), depth + 1)
                        except Unsatisfiable as e:
                            dead.setdefault("object", f"required property {name!r}: {e.path}: {e.why}")
                    else:
                        out[k][name] = self.child(s, child_path(p, name), depth + 1)
            elif k in ("patternProperties", "dependentSchemas"):
                out[k] = {n: self.child(s, child_path(p, n), depth + 1) for n, s in v.items()}
            elif k == "prefixItems":
                out[k] = [self.child(s, child_path(p, i), depth + 1) for i, s in enumerate(v)]
            elif k in SUBSCHEMA_ONE:
                out[k] = self.child(v, p, depth + 1)
            else:
                out[k] = v
        if out.get("not") == {}:
            raise Unsatisfiable(child_path(path, "not"), "'not' of a schema that accepts everything")
        if out.get("not") is False:
            del out["not"]                # not false: always true
        _tidy_items(out, dead)
        allof = [self.norm(r, child_path(path, "allOf"), depth + 1) for r in rest]
        for i, ite in enumerate(conds):   # not rewritable: kept, checked after generation
            node = {k: self.child(s, child_path(path, k), depth + 1) for k, s in ite.items()}
            if i == 0:
                out.update(node)
            else:
                allof.append(node)
        if allof:
            out["allOf"] = allof
        if dead:
            kinds = (ALL_KINDS if kinds is None else kinds) - frozenset().union(*(FAMILY_KINDS[f] for f in dead))
            if not kinds:
                raise Unsatisfiable(path, next(iter(dead.values())))
        if kinds is not None:
            out = {"type": _type_json(kinds), **{k: v for k, v in out.items() if k != "type" and (
                k not in KEY_FAMILY or FAMILY_KINDS[KEY_FAMILY[k]] & kinds)}}
        return out


def _valid(validator: Any, value: Any) -> bool:
    try:
        return validator.is_valid(value)
    except Exception:   # a pattern Python cannot read: drop the value, which only narrows
        return False


def _check_bounds(m: dict, kinds: frozenset[str] | None, dead: dict[str, str]) -> None:
    if kinds is not None and "integer" in kinds and "fraction" not in kinds:
        # integers only: whole, inclusive bounds (xgrammar refuses others), the same integers
        low = [math.ceil(m.pop("minimum"))] if "minimum" in m else []
        low += [math.floor(m.pop("exclusiveMinimum")) + 1] if "exclusiveMinimum" in m else []
        high = [math.floor(m.pop("maximum"))] if "maximum" in m else []
        high += [math.ceil(m.pop("exclusiveMaximum")) - 1] if "exclusiveMaximum" in m else []
        if low:
            m["minimum"] = max(low)
        if high:
            m["maximum"] = min(high)
    lows = [(m[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in m]
    highs = [(m[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in m]
    lo = max(lows, default=None)                                  # on a tie the exclusive bound
    hi = min(highs, default=None, key=lambda b: (b[0], not b[1]))  # is the tighter one
    if lo and hi and (lo[0] > hi[0] or (lo[0] == hi[0] and (lo[1] or hi[1]))):
        dead["number"] = f"no number lies between the lower bound {lo[0]} and the upper bound {hi[0]}"
    for fam, lo_kw, hi_kw in (("string", "minLength", "maxLength"), ("array", "minItems", "maxItems"),
                              ("array", "minContains", "maxContains"), ("object", "minProperties", "maxProperties")):
        if m.get(lo_kw, 0) > m.get(hi_kw, math.inf):
            dead[fam] = f"{lo_kw} {m[lo_kw]} > {hi_kw} {m[hi_kw]}"
    if len(set(m.get("required", []))) > m.get("maxProperties", math.inf):
        dead["object"] = f"{len(set(m['required']))} required properties > maxProperties {m['maxProperties']}"


def _declare_required(m: dict, required: list[str], dead: dict[str, str]) -> None:
    """A required name missing from properties, declared with the schema it already had there."""
    props = m["properties"] = dict(m.get("properties", {}))
    for name in required:
        if name in props:
            continue
        if any(_search(pat, name) for pat in m.get("patternProperties", {})):
            props[name] = True            # the patterns still apply; additionalProperties does not
        elif "additionalProperties" in m:
            props[name] = m["additionalProperties"]
        elif "unevaluatedProperties" not in m:
            props[name] = True
        # else: another subschema may evaluate it; left as it is (lint: checked)
        if props.get(name) is False:
            dead["object"] = f"required property {name!r} is not allowed by additionalProperties"


def _tidy_items(out: dict, dead: dict[str, str]) -> None:
    prefix = out.get("prefixItems")
    if prefix is not None and False in prefix:
        del prefix[prefix.index(False):]  # no item can stand at i: at most i items
        out["items"] = False
        if not prefix:
            del out["prefixItems"]
    if out.get("items") is False and out.get("minItems", 0) > len(out.get("prefixItems", [])):
        dead["array"] = f"minItems {out['minItems']} but at most {len(out.get('prefixItems', []))} items are allowed"


def _disjoint(a: dict, b: dict) -> bool:
    """True when no instance satisfies both normalized schemas (a sufficient test, not a complete one)."""
    ka = _value_kinds(a["enum"]) if "enum" in a else _kinds(a.get("type"))
    kb = _value_kinds(b["enum"]) if "enum" in b else _kinds(b.get("type"))
    if ka is not None and kb is not None and not ka & kb:
        return True
    if "enum" in a and "enum" in b:
        return not {_key(v) for v in a["enum"]} & {_key(v) for v in b["enum"]}
    if ka == kb == {"object"}:
        for name in set(a.get("required", [])) & set(b.get("required", [])):
            sa, sb = a.get("properties", {}).get(name), b.get("properties", {}).get(name)
            if isinstance(sa, dict) and isinstance(sb, dict) and _disjoint(sa, sb):
                return True
    return False


# ---------------------------------------------------------------- type inference (the narrowing rule)


def _infer_types(root: dict) -> None:
    """Add `type` where keywords name their type family, except where narrowing would widen: under
    not/if/contains/oneOf, and in every $defs entry such a place refers to."""
    def target(ref: str) -> Any:
        if ref == "#":
            return root
        container, name = ref[2:].split("/", 1)
        return root.get(container, {}).get(name.replace("~1", "/").replace("~0", "~"))

    negative_refs: set[str] = set()
    seen: set[tuple[int, bool]] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, neg = stack.pop()
        if not isinstance(node, dict) or (id(node), neg) in seen:
            continue
        seen.add((id(node), neg))
        if "$ref" in node:
            if neg:
                negative_refs.add(node["$ref"])
            stack.append((target(node["$ref"]), neg))
        stack.extend((sub, neg or kw in NEGATIVE) for kw, _, sub in subschemas(node) if kw not in ("$defs", "definitions"))
    if "#" in negative_refs:
        return
    done: set[int] = set()
    stack2: list[Any] = [root]
    while stack2:
        node = stack2.pop()
        if not isinstance(node, dict) or id(node) in done:
            continue
        done.add(id(node))
        if "$ref" in node and node["$ref"] not in negative_refs:
            stack2.append(target(node["$ref"]))
        _infer(node)
        stack2.extend(sub for kw, _, sub in subschemas(node) if kw not in NEGATIVE and kw not in ("$defs", "definitions"))


def _infer(node: dict) -> None:
    if any(k in node for k in ("type", "enum", "$ref", "anyOf", "oneOf")):
        return
    families = {KEY_FAMILY[k] for k in node if k in KEY_FAMILY}
    if families:
        kinds = frozenset().union(*(FAMILY_KINDS[f] for f in families))
        items = list(node.items())
        node.clear()
        node.update([("type", _type_json(kinds)), *items])
