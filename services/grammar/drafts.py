"""Older JSON Schema drafts (4, 6, 7, 2019-09) rewritten as Draft 2020-12, which is what
normalize.py and the grammar compilers read. Real-world schemas declare every draft: SchemaStore
configs are mostly Draft 7, Kubernetes and CloudFormation Draft 4. Each rule keeps the meaning:

    Draft 4  "id"                                -> "$id" (root) / dropped (below: local refs only)
    Draft 4  "exclusiveMinimum": true + minimum  -> "exclusiveMinimum": <minimum>   (and Maximum)
    4 to 7   "items": [a, b] + "additionalItems" -> "prefixItems": [a, b] + "items"
    6, 7     "$id": "#name"                      -> "$anchor": "name"
    2019-09  "$recursiveRef": "#"                -> "$ref": "#"  ("$recursiveAnchor" dropped: with no
             other anchor in play it resolves to the root, which is the only case served)

`dependencies` is read by normalize.py itself. The finished output is validated with the declared
draft's own validator (scheduler/structured.py), so a rewrite can never let an invalid output pass.
"""
from __future__ import annotations

from typing import Any

from jsonschema import Draft4Validator, Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from radixflow.shared.errors import BadRequest

DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"
MAX_DEPTH = 256
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames", "contains", "not",
        "if", "then", "else", "additionalItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def declared(schema: dict) -> type:
    """The validator class of the draft `schema` declares (2020-12 when it declares none)."""
    return validator_for(schema, default=Draft202012Validator)


def id_keyword(schema: dict) -> str:
    """The keyword that gives a subschema its URI under `schema`'s draft."""
    return "id" if declared(schema) is Draft4Validator else "$id"


def check(schema: dict) -> type:
    """A 400 unless `schema` is valid under the draft it declares (2020-12 when none); returns
    that draft's validator class. The one place a schema's validity is checked (it is the slow
    part of compiling a large schema)."""
    cls = declared(schema)
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        raise BadRequest(f"invalid JSON Schema at {e.json_path}: {e.message}", param="response_format") from None
    except RecursionError:
        raise BadRequest("the JSON Schema is nested too deeply", param="response_format") from None
    return cls


def to_2020(schema: dict, checked: bool = False) -> dict:
    """`schema` as Draft 2020-12; a 400 when it is invalid under its own declared draft (unless
    `checked`: the caller already ran check on it)."""
    if (declared(schema) if checked else check(schema)) is Draft202012Validator:
        return schema
    out = _upgrade(schema, root=True, depth=0)
    out["$schema"] = DRAFT_2020
    return out


def _upgrade(node: Any, root: bool, depth: int) -> Any:
    if not isinstance(node, dict):
        return node
    if depth > MAX_DEPTH:
        raise BadRequest("the JSON Schema is nested too deeply", param="response_format")
    n = dict(node)
    if "id" in n and isinstance(n["id"], str) and "$id" not in n:
        ident = n.pop("id")
        if root:
            n["$id"] = ident
    if isinstance(n.get("$id"), str) and n["$id"].startswith("#"):
        n["$anchor"] = n.pop("$id")[1:]
    elif "$id" in n and not root:
        n.pop("$id")                       # below the root only local refs are served
    for bound in ("Minimum", "Maximum"):
        ex, plain = f"exclusive{bound}", bound.lower()
        if isinstance(n.get(ex), bool):
            if n.pop(ex) and plain in n:
                n[ex] = n.pop(plain)
    if "$recursiveRef" in n:
        n["$ref"] = n.pop("$recursiveRef")
    n.pop("$recursiveAnchor", None)
    sub = lambda v: _upgrade(v, False, depth + 1)   # noqa: E731
    if isinstance(n.get("items"), list):
        n["prefixItems"] = n.pop("items")
        if "additionalItems" in n:
            n["items"] = n.pop("additionalItems")
    else:
        n.pop("additionalItems", None)     # meaningless without an items array
    for kw in _MAPS:
        if isinstance(n.get(kw), dict):
            n[kw] = {k: sub(v) for k, v in n[kw].items()}
    if isinstance(n.get("dependencies"), dict):
        n["dependencies"] = {k: v if isinstance(v, list) else sub(v) for k, v in n["dependencies"].items()}
    for kw in _ONE + ("items",):
        if kw in n:
            n[kw] = sub(n[kw])
    for kw in _LISTS:
        if isinstance(n.get(kw), list):
            n[kw] = [sub(v) for v in n[kw]]
    return n
