"""The checks a merged schema gets before it is compiled (normalize.py): numeric and size bounds
that leave nothing (Unsatisfiable, or a kind dropped from the type), required names a closed
object cannot have, items past a tuple's end, and whether two branches can share an instance
(oneOf branches that cannot are anyOf). Pure functions on schema dicts."""
from __future__ import annotations

import math
from typing import Any

from radixflow.shared import patterns

from .merge import _key, _kinds, _search, _value_kinds


def _valid(validator: Any, value: Any) -> bool:
    try:
        return validator.is_valid(value)
    except patterns.PatternTimeout:
        raise           # a hostile pattern: the schema is refused (compiler.py), not the value dropped
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


def _forbids(s: dict, name: str) -> bool:
    """True when the normalized object schema `s` admits no property `name`."""
    declared = s.get("properties", {})
    if name in declared:
        return declared[name] is False
    return s.get("additionalProperties", True) is False and not s.get("patternProperties")


def _disjoint(a: dict, b: dict) -> bool:
    """True when no instance satisfies both normalized schemas (a sufficient test, not a complete one)."""
    ka = _value_kinds(a["enum"]) if "enum" in a else _kinds(a.get("type"))
    kb = _value_kinds(b["enum"]) if "enum" in b else _kinds(b.get("type"))
    if ka is not None and kb is not None and not ka & kb:
        return True
    if "enum" in a and "enum" in b:
        return not {_key(v) for v in a["enum"]} & {_key(v) for v in b["enum"]}
    if ka == kb == {"object"}:
        for x, y in ((a, b), (b, a)):
            # a property one requires and the other forbids (not {required: [p]}, or no room for it)
            if any(_forbids(y, name) for name in x.get("required", [])):
                return True
        for name in set(a.get("required", [])) & set(b.get("required", [])):
            sa, sb = a.get("properties", {}).get(name), b.get("properties", {}).get(name)
            if isinstance(sa, dict) and isinstance(sb, dict) and _disjoint(sa, sb):
                return True
    return False
