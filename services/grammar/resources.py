"""localize(schema): a compound schema document made to refer within itself by JSON pointers.

A bundled schema embeds other schemas as resources: a subschema with its own `$id` (`id` in Draft 4),
referred to by that URI (`"$ref": "http://example.com/address.json"`), by a pointer into it
(`"...address.json#/definitions/street"`), or from inside it by a reference relative to it
(`"#/definitions/street"` there means the resource's own definitions, not the root's). Generated
and bundled API schemas (AsyncAPI, OpenAPI tooling, JSON Schema bundlers) are written this way. A
grammar compiler sees one document and `#/...` pointers from its root, so every reference that
resolves to a resource of the document is rewritten as the pointer to where that lies in it, and the
embedded identifiers are dropped (nothing refers by them any more). The meaning is unchanged. A
reference to anything outside the document is left as written (the lint refuses it by name).
"""
from __future__ import annotations

from typing import Any
from urllib.parse import quote, unquote, urldefrag, urljoin


_BASE = "urn:radixflow:schema"            # the root's URI when it names none
_SAFE = "/~!$&'()*+,;=:@"                 # left as written in a pointer fragment (RFC 3986 pchar)
# every draft's subschema keywords: this runs before older drafts are rewritten (drafts.py)
_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions", "dependencies")
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "propertyNames", "contains", "not", "if", "then", "else")
_LISTS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")


def subschemas(node: dict):
    """(keyword, name or index or None, subschema) for every schema directly inside `node`."""
    for kw in _MAPS:
        if isinstance(node.get(kw), dict):
            # dependencies' lists are property names (Draft 7's dependentRequired), not schemas
            yield from ((kw, k, v) for k, v in node[kw].items() if isinstance(v, (dict, bool)))
    for kw in _ONE:
        if isinstance(node.get(kw), (dict, bool)):
            yield kw, None, node[kw]
    for kw in _LISTS:
        if isinstance(node.get(kw), list):
            yield from ((kw, i, v) for i, v in enumerate(node[kw]))


def localize(schema: Any, id_keyword: str = "$id") -> Any:
    """`schema` with references into its embedded resources as local pointers (a copy), or
    `schema` itself when it embeds none. `id_keyword`: "id" for a Draft 4 schema."""
    if not isinstance(schema, dict) or not _embeds(schema, id_keyword):
        return schema
    resources: dict[str, str] = {}        # absolute URI (no fragment) -> JSON pointer
    anchors: dict[str, str] = {}          # absolute URI#name -> JSON pointer
    _index(schema, "", _BASE, id_keyword, resources, anchors, root=True)
    return _rewrite(schema, _BASE, id_keyword, resources, anchors, root=True)


def for_engines(schema: Any, id_keyword: str = "$id") -> Any:
    """localize(schema), and without the root's identifier where every reference is local then: an
    engine that resolves references against it (llguidance) refuses one with a fragment
    (`"$id": "release-it#release-it"`), and no reference needs it."""
    out = localize(schema, id_keyword)
    if not isinstance(out, dict) or id_keyword not in out or not _all_local(out):
        return out
    out = dict(out)
    del out[id_keyword]
    return out


def _all_local(schema: dict) -> bool:
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and not node["$ref"].startswith("#"):
                return False
            stack.extend(sub for _, _, sub in subschemas(node))
    return True


def _embeds(schema: dict, id_keyword: str) -> bool:
    stack = [sub for _, _, sub in subschemas(schema)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get(id_keyword), str) and not node[id_keyword].startswith("#"):
                return True
            stack.extend(sub for _, _, sub in subschemas(node))
    return False


def _base(node: dict, base: str, id_keyword: str) -> str:
    ident = node.get(id_keyword)
    if isinstance(ident, str) and not ident.startswith("#"):
        return urldefrag(urljoin(base, ident))[0]
    return base


def _index(node: Any, pointer: str, base: str, id_keyword: str, resources: dict, anchors: dict,
           root: bool = False) -> None:
    if not isinstance(node, dict):
        return
    inner = _base(node, base, id_keyword)
    if root:
        resources.setdefault(_BASE, "")
    if root or inner != base:
        resources.setdefault(inner, pointer)
    base = inner
    ident = node.get(id_keyword)
    if isinstance(ident, str) and ident.startswith("#") and len(ident) > 1:   # Draft 6/7 plain-name id
        anchors.setdefault(f"{base}#{ident[1:]}", pointer)
    if isinstance(node.get("$anchor"), str):
        anchors.setdefault(f"{base}#{node['$anchor']}", pointer)
    for kw, key, sub in subschemas(node):
        tail = "" if key is None else "/" + str(key).replace("~", "~0").replace("/", "~1")
        _index(sub, f"{pointer}/{kw}{tail}", base, id_keyword, resources, anchors)


def _rewrite(node: Any, base: str, id_keyword: str, resources: dict, anchors: dict, root: bool = False) -> Any:
    if not isinstance(node, dict):
        return node
    base = _base(node, base, id_keyword)
    out = dict(node)
    if not root and isinstance(out.get(id_keyword), str) and not out[id_keyword].startswith("#"):
        del out[id_keyword]
    if isinstance(out.get("$ref"), str):
        out["$ref"] = _local(out["$ref"], base, resources, anchors)
    for kw, key, sub in subschemas(node):
        new = _rewrite(sub, base, id_keyword, resources, anchors)
        if key is None:
            out[kw] = new
        else:
            container = out[kw] = dict(out[kw]) if isinstance(out[kw], dict) else list(out[kw])
            container[key] = new
    return out


def _local(ref: str, base: str, resources: dict, anchors: dict) -> str:
    uri, fragment = urldefrag(urljoin(base, ref))
    if uri not in resources:
        return ref
    fragment = unquote(fragment)
    if fragment and not fragment.startswith("/"):
        pointer = anchors.get(f"{uri}#{fragment}")
        if pointer is None:
            return ref
        return "#" + quote(pointer, safe=_SAFE)
    return "#" + quote(resources[uri] + fragment, safe=_SAFE)
