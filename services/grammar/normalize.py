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
import time
from typing import Any
from urllib.parse import unquote

from jsonschema import Draft202012Validator

from radixflow.shared.errors import BadRequest

# the algebra (merge.py) is this module's own: its private helpers are shared on purpose
from .checks import _check_bounds, _declare_required, _disjoint, _tidy_items, _valid
from .merge import (ALL_KINDS, FAMILY_KINDS, KEY_FAMILY, MAX_CONDITIONALS, MAX_DEPTH, MAX_INLINE, MAX_NODES, NEGATIVE,
                    SUBSCHEMA_ONE, UNEVALUATED, TooLarge, Unsatisfiable, Unsupported, _applicators, _key, _kinds, _localize,
                    _merge, _split_dependent, _split_if, _strip, _type_json, child_path, subschemas)


# the work one normalization may do (seconds of one thread, holding the GIL): past it, as past
# MAX_NODES, the exact rewrite gives way to the widened one, and that to llguidance
NORMALIZE_BUDGET_S = 5.0
# conjunctions of two or more references met in one exact rewrite. A schema that extends a recursive
# one (allOf [a metaschema, keywords of its own], each recursive) merges them at every level and
# grows past MAX_NODES (AsyncAPI's schema object does); no schema of the corpora that normalizes
# exactly has more than 6.
MAX_CONJUNCTIONS = 64
MAX_PASSES = 4           # rewrites of the whole schema as entries nothing satisfies come to light


def normalize(schema: dict) -> dict:
    """`schema` rewritten by the rules above; BadRequest (400) when it is unsatisfiable, refers to
    anything but itself, or is too deep or too large. Expects a schema that passed
    Draft202012Validator.check_schema."""
    return _run(_Normalizer(schema))


def widened(schema: dict) -> tuple[dict, bool]:
    """(`schema` normalized, whether it was widened). Exact where that fits in MAX_NODES; else
    WIDENS: a conjunction of two or more references keeps the first it meets (any one part of an
    allOf admits everything the whole does). What recursive references merged with each other
    expand into (a schema that extends a metaschema: allOf [the metaschema, its own keywords],
    both recursive) then stays bounded; the output is checked against the schema as sent."""
    try:
        return normalize(schema), False
    except TooLarge:
        n = _Normalizer(schema, widen=True)
        return _run(n), n.widened


def _absent(negated: Any) -> str | None:
    """The property a `not` forbids when it is `{"required": [name]}` (annotations aside), else None."""
    if not isinstance(negated, dict):
        return None
    kept = _strip(negated)
    if set(kept) != {"required"} or not isinstance(kept["required"], list) or len(kept["required"]) != 1:
        return None
    name = kept["required"][0]
    return name if isinstance(name, str) else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _run(n: "_Normalizer") -> dict:
    try:
        return n.run()
    except Unsatisfiable as e:
        raise BadRequest(f"the JSON Schema is unsatisfiable at {e.path}: {e.why}", param="response_format") from None


# ---------------------------------------------------------------- the walk


class _Normalizer:
    def __init__(self, root: dict, widen: bool = False):
        self.root = root
        self.widen = widen
        self.widened = False
        self.conjunctions = 0
        self.validator = Draft202012Validator(root, format_checker=Draft202012Validator.FORMAT_CHECKER)
        self.anchors = self._anchors()
        self.dead: set[str] = set()              # entries (their unit keys) that nothing satisfies
        self.nodes = 0
        # every keyed dict's and list's canonical text, kept with it (so that its id is not reused):
        # merged nodes are built of the root's parts and of each other, and keying each merged node
        # by its whole text walked them again at every level. Nothing keyed is changed afterwards.
        self.texts: dict[int, tuple[Any, str]] = {}
        self.deadline = time.monotonic() + NORMALIZE_BUDGET_S

    def run(self) -> dict:
        # an entry nothing satisfies is found only when the queue reaches it, after the places that
        # refer to it were written; they are written again knowing it, as they would have been had
        # it been inline: a branch that needs it dropped, an optional property absent, and the whole
        # schema unsatisfiable only if the root needs it (an engine may refuse a `false` entry)
        for _ in range(MAX_PASSES):
            out, dead = self._pass()
            if not dead - self.dead:
                break
            self.dead |= dead
        else:
            raise TooLarge("the JSON Schema's unsatisfiable parts refer to each other too deeply", param="response_format")
        out.update({c: entries for c, entries in self.defs.items() if entries})
        _infer_types(out)
        return out

    def _pass(self) -> tuple[dict, set[str]]:
        self.defs: dict[str, dict] = {"$defs": {}, "definitions": {}}
        self.units: dict[str, str] = {}          # JSON pointer, or a merged node's key -> output $ref
        self.queue: list[tuple[str, str, Any, str, str]] = []   # (container, name, raw schema, path, key)
        self.active: set[str] = set()            # merged nodes being normalized, for recursion
        self.done: dict[str, dict] = {}          # merged nodes normalized once: key -> result
        out = self.norm(self.root, "$", 0)
        dead: set[str] = set()
        while self.queue:
            container, name, raw, path, key = self.queue.pop()
            # an entry whose schema was already normalized inline (a recursive node's first
            # occurrence) takes that result: normalizing it again would find itself in self.done
            done = self.done.get(self._key(raw)) if isinstance(raw, dict) else None
            if done is None:
                try:
                    done = self.norm(raw, path, 0)
                except Unsatisfiable:
                    done = False
                    dead.add(key)
            self.defs[container][name] = done
        return out, dead

    def _key(self, v: Any) -> str:
        """Equal for equal schemas (key order aside, 1 == 1.0), as merge._key, remembered per object."""
        if not isinstance(v, (dict, list)):
            return _key(v)
        hit = self.texts.get(id(v))
        if hit is not None:
            return hit[1]
        if isinstance(v, dict):
            text = "{" + ",".join(json.dumps(k) + ":" + self._key(v[k]) for k in sorted(v)) + "}"
        else:
            text = "[" + ",".join(self._key(x) for x in v) + "]"
        self.texts[id(v)] = (v, text)
        return text

    def _unit(self, key: str, raw: Any, path: str, container: str = "$defs", name: str = "") -> str:
        """The output $ref of an entry normalized once, from the queue (never recursively)."""
        if key in self.dead:
            raise Unsatisfiable(path, "it refers to a schema that nothing satisfies")
        ref = self.units.get(key)
        if ref is None:
            name = name or self._free_name()
            ref = self.units[key] = f"#/{container}/" + name.replace("~", "~0").replace("/", "~1")
            self.queue.append((container, name, raw, path, key))
        return ref

    def _free_name(self) -> str:
        taken = set(self.root.get("$defs", {})) | set(self.defs["$defs"]) | {
            r.rsplit("/", 1)[1] for r in self.units.values() if r.startswith("#/$defs/")}
        return next(f"ref{i}" for i in range(len(taken) + 1) if f"ref{i}" not in taken)

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
        raise Unsupported(f"unsupported JSON Schema construct '$ref' at {path}: only references within the schema "
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
        if self.nodes % 256 == 0 and time.monotonic() > self.deadline:
            raise TooLarge(f"the JSON Schema takes over {NORMALIZE_BUDGET_S:g} s to normalize (its allOf, $ref "
                           "and if/then/else expand too far); simplify it", param="response_format")
        if self.nodes > MAX_NODES:
            raise TooLarge(f"the JSON Schema expands to over {MAX_NODES} subschemas once its allOf, $ref and "
                             "if/then/else are resolved; simplify it", param="response_format")
        if node is True:
            return {}
        if node is False:
            raise Unsatisfiable(path, "the schema is false")
        if not isinstance(node, dict):
            # only where no metaschema looks: under a keyword JSON Schema does not define, reached by a $ref
            raise BadRequest(f"the JSON Schema has {type(node).__name__} {_short(node)} at {path} where a schema (an "
                             "object or a boolean) must be", param="response_format")
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
        key = self._key(node)
        if key in self.active or len(self.active) >= MAX_INLINE:
            return {"$ref": self._unit(key, node, path)}
        done = self.done.get(key)
        if done is not None:
            # met again: the same text is the same schema, so it becomes a $defs entry holding what
            # was computed the first time (a large allOf or $ref-with-siblings used in many places,
            # say a CI step's anyOf of hundreds of tasks, would otherwise be expanded at each), or
            # refers to the entry it already has (a recursive one, normalized from the queue)
            if key not in self.units:
                self.units[key] = f"#/$defs/{self._free_name()}"
                self.defs["$defs"][self.units[key].rsplit("/", 1)[1]] = done
            return {"$ref": self.units[key]}
        self.active.add(key)
        try:
            out = self._norm_merged(node, path, depth)
        finally:
            self.active.discard(key)
        self.done[key] = out
        return out

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
            if not isinstance(s, dict):
                raise BadRequest(f"the JSON Schema has {type(s).__name__} {_short(s)} in an allOf or $ref at {path} "
                                 "where a schema (an object or a boolean) must be", param="response_format")
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
                if seen and pointer not in seen:
                    if self.widen:
                        self.widened = True   # WIDENS: the conjunction keeps its first reference
                        continue
                    self.conjunctions += 1
                    if self.conjunctions > MAX_CONJUNCTIONS:
                        raise TooLarge(f"the JSON Schema merges references with each other over {MAX_CONJUNCTIONS} "
                                       "times (recursive schemas extending each other)", param="response_format")
                if pointer not in seen:   # A and A is A: a reference cycle adds nothing
                    seen.add(pointer)
                    stack.append((self._deref(pointer, "#" + pointer, path)[0], False))
                continue
            if "allOf" in s:
                s = dict(s)
                stack.extend((sub, False) for sub in reversed(s.pop("allOf")))
                stack.append((s, top))
                continue
            absent = _absent(s.get("not"))
            if absent is not None:
                # not {required: [p]}: p is absent, which a grammar can say (mutually exclusive
                # properties are written so); ignored, it was left to the output check
                s = {k: v for k, v in s.items() if k != "not"}
                parts.append({"properties": {absent: False}})
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
