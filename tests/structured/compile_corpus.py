"""How long does each schema of a corpus take to compile, per grammar engine and under `auto`, with
nothing else running? Not a test: a report for tuning compiler._auto (issue 10: compile p99 < 1 s).

    .venv/bin/python tests/structured/compile_corpus.py --model /tmp/rfm/tiny-hybrid
        [--dir tests/structured/realworld/schemas] [--modes auto,xgrammar,llguidance]
        [--only name,name] [--limit N] [--json out.json]

It drives the grammar service's own Compiler (the same workers, lint.prepare, budget and deadline as
in the stack), one schema at a time, and waits for every job of a schema to end (an auto try that
ran over the budget goes on in the background) before the next, so each compile has the machine to
itself. Per schema and mode: the wall time of Compiler.compile (what a request waits for, queueing
on an idle pool included), the backend and enforcement it got, or the refusal reason. An explicit
engine whose result auto already cached reports the cached entry's compile time. Also, in-process
and tokenizer-free: lint.prepare's time, and the size of the schema xgrammar is given and of the
grammar it prints (what a cheap predictor could read).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from radixflow.services.bench.schemas import refusal_reason
from radixflow.services.grammar.compiler import Compiler
from radixflow.shared.errors import RadixflowError

DEFAULT_DIR = Path(__file__).resolve().parent / "realworld" / "schemas"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def features(text: str) -> dict:
    """What lint.prepare costs, and how large the prepared schema and xgrammar's printed grammar are."""
    from radixflow.services.grammar.backends.xgrammar import json_schema_grammar
    from radixflow.services.grammar.lint import prepare
    t0 = time.perf_counter()
    try:
        prepared, _ = prepare(json.loads(text))
    except RadixflowError as e:
        return {"prepare_s": time.perf_counter() - t0, "prepare_error": e.message[:200]}
    prepare_s = time.perf_counter() - t0
    prepared_text = json.dumps(prepared, separators=(",", ":"), ensure_ascii=False)
    t1 = time.perf_counter()
    try:
        ebnf = len(str(json_schema_grammar(prepared_text)))
    except Exception as e:   # what the worker would report as "does not compile"
        ebnf = f"{type(e).__name__}: {str(e)[:100]}"
    return {"prepare_s": prepare_s, "prepared_bytes": len(prepared_text), "ebnf_chars": ebnf,
            "ebnf_s": time.perf_counter() - t1}


async def _settle(c: Compiler) -> None:
    """Until no job is in flight and every worker is back and idle: a worker killed at the deadline
    is replaced in the background, and the next compile must neither wait for it nor share the CPU
    with its startup."""
    # the compiler keeps no public count of in-flight jobs; a report script may look
    while c._inflight:
        await asyncio.gather(*list(c._inflight.values()), return_exceptions=True)
        await asyncio.sleep(0)
    while c.workers_ready < c.n_workers:
        await asyncio.sleep(0.05)


async def compile_one(c: Compiler, text: str, mode: str) -> dict:
    t0 = time.perf_counter()
    try:
        r = await c.compile("json_schema", text, mode)
    except RadixflowError as e:
        return {"wall_s": time.perf_counter() - t0, "refused": refusal_reason(e.message), "message": e.message[:300]}
    wall = time.perf_counter() - t0
    entry = c.fetch(r.key)
    return {"wall_s": wall, "compile_s": r.compile_s, "cache_hit": r.cache_hit,
            "cached_compile_s": entry.compile_s if entry else None, "backend": r.backend,
            "enforcement": r.enforcement, "size": r.size}


async def run(model: str, paths: list[Path], modes: list[str], with_features: bool) -> list[dict]:
    c = Compiler(model, backend="auto")
    await c.start()
    out = []
    try:
        for i, p in enumerate(paths):
            text = p.read_text(encoding="utf-8")
            rec = {"name": p.stem, "bytes": len(text)}
            for mode in modes:
                rec[mode] = await compile_one(c, text, mode)
                await _settle(c)
            if with_features:
                rec["features"] = await asyncio.to_thread(features, text)
            out.append(rec)
            cells = "  ".join(f"{m}={rec[m]['wall_s']:.3f}:{rec[m].get('backend') or rec[m].get('refused')}"
                              for m in modes)
            print(f"[{i + 1}/{len(paths)}] {p.stem} {cells}", file=sys.stderr, flush=True)
    finally:
        await c.stop()
    return out


def seconds(rec: dict, mode: str) -> float:
    """The engine's time for an explicit mode answered from auto's cache entry; else the wall."""
    r = rec[mode]
    return r["cached_compile_s"] if r.get("cache_hit") and r.get("cached_compile_s") is not None else r["wall_s"]


def report(records: list[dict], modes: list[str], slow_s: float) -> str:
    lines = []
    for mode in modes:
        ok = [r for r in records if "refused" not in r[mode]]
        lines.append(f"{mode}: compiled {len(ok)}/{len(records)}")
        by_backend: dict[str, list[float]] = {}
        for r in ok:
            by_backend.setdefault(r[mode]["backend"], []).append(seconds(r, mode))
        everything = [seconds(r, mode) for r in ok]
        for b, xs in sorted(by_backend.items()) + ([("all", everything)] if everything else []):
            lines.append(f"  {b:11s} n={len(xs):4d} p50={_pct(xs, .5):7.3f} p99={_pct(xs, .99):7.3f} max={max(xs):7.3f}")
        refused: dict[str, int] = {}
        for r in records:
            if "refused" in r[mode]:
                refused[r[mode]["refused"]] = refused.get(r[mode]["refused"], 0) + 1
        for why, n in sorted(refused.items(), key=lambda kv: -kv[1]):
            lines.append(f"  refused {n:4d}  {why}")
        slow = sorted((r for r in records if seconds(r, mode) > slow_s), key=lambda r: -seconds(r, mode))
        if slow:
            lines.append(f"  over {slow_s:g}s: " + ", ".join(f"{r['name']} {seconds(r, mode):.2f}" for r in slow))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dir", default=str(DEFAULT_DIR))
    ap.add_argument("--modes", default="auto,xgrammar,llguidance")
    ap.add_argument("--only", default="", help="comma-separated schema names (file stems)")
    ap.add_argument("--limit", type=int, default=0, help="only N files, spread over the sorted names")
    ap.add_argument("--no-features", action="store_true", help="skip the in-process prepare/EBNF sizes")
    ap.add_argument("--slow", type=float, default=1.0, help="list the schemas slower than this (seconds)")
    ap.add_argument("--json", help="write the per-schema records here")
    a = ap.parse_args()
    paths = sorted(Path(a.dir).glob("*.json"))
    only = set(filter(None, a.only.split(",")))
    if only:
        paths = [p for p in paths if p.stem in only]
    if 0 < a.limit < len(paths):
        paths = [paths[i * len(paths) // a.limit] for i in range(a.limit)]
    modes = a.modes.split(",")
    records = asyncio.run(run(a.model, paths, modes, not a.no_features))
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "modes": modes, "schemas": records}, indent=1))
    print(report(records, modes, a.slow))


if __name__ == "__main__":
    main()
