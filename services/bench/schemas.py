"""`radixflow bench schemas DIR`: every JSON Schema in DIR (*.json, one schema each) through the
whole stack as an OpenAI `response_format`, and what became of it.

Per schema, at most `concurrency` schemas in flight:

1. probe: POST /generate with the schema as `json_schema` and max_new_tokens 1. Its wall time is
   the cold compile plus one token (the first request for a schema pays the compile; later ones
   hit the grammar cache). A 400 here is a refusal, bucketed by `refusal_reason`; a probe that is
   cut at its one token (200, or the 400 "max_tokens was reached") means the schema compiled.
2. samples: POST /v1/chat/completions with the json_schema response_format, temperature 1.0 and
   seeds seed, seed+1, ...; each answer is one of
     valid            200, parses, and validates (jsonschema, the validator of the schema's declared
                      draft, with its format checker)
     invalid          200 but not JSON or not valid: a broken guarantee, must be 0
     truncated        finish_reason "length", or the server's 400 "max_tokens was reached"
     rejected_output  the server's own check refused its output (after any resamples): 500
     unchecked        200 but the validator itself failed (a pattern Python's re cannot compile)
     error            anything else (status, timeout), with a reason

Nothing here raises for one schema: a bad file, a timeout or a dropped connection becomes a record.
The grammar backend comes from the `x-radixflow-grammar-backend` header or meta_info.grammar,
resamples from `x-radixflow-resamples`; both are optional ("default" and 0 when absent).
"""
from __future__ import annotations

import asyncio
import json
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

SAMPLE_OUTCOMES = ("valid", "invalid", "truncated", "rejected_output", "unchecked", "error")
PROMPT = "Write one JSON document that conforms to the JSON Schema named {name!r}. Answer with the JSON only."


@dataclass(frozen=True)
class SchemasBenchConfig:
    max_tokens: int = 2048
    samples: int = 1
    concurrency: int = 4
    seed: int = 0
    timeout_s: float = 300.0          # per HTTP request
    limit: int = 0                    # 0: every schema in DIR; else N spread over the sorted names


# ---------------------------------------------------------------- classification

def _words(text: str, n: int) -> str:
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'_'", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return " ".join(text.split()[:n]).rstrip(":;,.")


_WHY = [(r"keywords beside '([^']+)'", lambda m: f"beside {m.group(1)}"), (r'it needs "type"', "needs type"),
        (r"ignores it", "ignored"), (r"is not enforced", "not enforced"), (r"only local references", "non-local"),
        (r"can never be written", "keys unwritable"), (r"single-subschema", "several subschemas")]


def _construct(m: re.Match) -> str:
    why = m.group(2) or ""
    for pattern, short in _WHY:
        w = re.search(pattern, why)
        if w:
            return f"construct {m.group(1)} ({short(w) if callable(short) else short})"
    return f"construct {m.group(1)}" + (f" ({_words(why, 3)})" if why else "")


_REASONS: list[tuple[str, object]] = [
    (r"unsupported JSON Schema construct '([^']+)'(?: at .*?: (.*))?$", _construct),
    (r"took longer than", "compile timeout"),
    (r"MiB compressed, over the", "blob too large"),
    (r"^invalid JSON Schema", "invalid schema"),
    (r"^invalid JSON in", "invalid JSON"),
    (r"nested too deeply", "nested too deeply"),
    (r"cannot be enforced exactly: (.*)", lambda m: "unenforceable: " + _words(m.group(1), 5)),
    (r"does not compile: (.*)", lambda m: "does not compile: " + _words(m.group(1), 5)),
    (r"max_tokens was reached", "truncated"),
]


def refusal_reason(message: str) -> str:
    """A short bucket for a 400's message: "construct uniqueItems (ignored)", "compile timeout", ..."""
    for pattern, name in _REASONS:
        m = re.search(pattern, message)
        if m:
            return name(m) if callable(name) else name
    return _words(message, 6) or "(no message)"


def check_output(schema: dict, text: str | None) -> tuple[str, str | None]:
    """("valid" | "invalid" | "unchecked", why) for a returned document, with the validator of the
    schema's declared draft (2020-12 when it declares none)."""
    from jsonschema import validators
    try:
        value = json.loads(text or "")
    except ValueError as e:
        return "invalid", f"not JSON: {e}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls = validators.validator_for(schema, default=validators.Draft202012Validator)
        err = next(iter(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)), None)
    except Exception as e:     # the validator cannot evaluate this schema (e.g. an ECMA-only regex)
        return "unchecked", f"{type(e).__name__}: {str(e)[:200]}"
    if err is not None:
        return "invalid", f"at {'/'.join(map(str, err.absolute_path)) or '$'}: {err.message[:200]}"
    return "valid", None


# ---------------------------------------------------------------- requests

async def _post(http: aiohttp.ClientSession, url: str, body: dict, timeout_s: float) -> tuple[int, dict, dict, float]:
    """(status, headers, JSON body, seconds); status 0 with {"error": {"message"}} for a timeout or a
    client failure."""
    t0 = time.perf_counter()
    try:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            try:
                data = await r.json(content_type=None)
            except ValueError:
                data = {"error": {"message": (await r.text())[:300]}}
            return r.status, dict(r.headers), data if isinstance(data, dict) else {}, time.perf_counter() - t0
    except asyncio.TimeoutError:
        return 0, {}, {"error": {"message": "timeout"}}, time.perf_counter() - t0
    except aiohttp.ClientError as e:
        return 0, {}, {"error": {"message": f"client: {type(e).__name__}"}}, time.perf_counter() - t0


def _message(data: dict) -> str:
    err = data.get("error")
    return str(err.get("message", "")) if isinstance(err, dict) else str(err or "")


def _backend(headers: dict, data: dict) -> str | None:
    meta = data.get("meta_info") if isinstance(data.get("meta_info"), dict) else {}
    grammar = meta.get("grammar") if isinstance(meta.get("grammar"), dict) else {}
    return headers.get("x-radixflow-grammar-backend") or headers.get("X-Radixflow-Grammar-Backend") \
        or grammar.get("backend")


def _resamples(headers: dict, data: dict) -> int:
    raw = headers.get("x-radixflow-resamples") or headers.get("X-Radixflow-Resamples")
    if raw is None:
        raw = (data.get("usage") or {}).get("resamples", 0) if isinstance(data.get("usage"), dict) else 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        return 0


async def _sample(http, base: str, name: str, schema: dict, seed: int, cfg: SchemasBenchConfig) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT.format(name=name)}],
            "temperature": 1.0, "seed": seed, "max_tokens": cfg.max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {"name": name[:64], "schema": schema}}}
    status, headers, data, secs = await _post(http, base + "/v1/chat/completions", body, cfg.timeout_s)
    out = {"seed": seed, "status": status, "seconds": round(secs, 3), "resamples": _resamples(headers, data),
           "backend": _backend(headers, data), "finish_reason": None, "completion_tokens": None, "detail": None}
    msg = _message(data)
    if status == 200:
        try:
            choice = data["choices"][0]
            text, out["finish_reason"] = choice["message"]["content"], choice.get("finish_reason")
            out["completion_tokens"] = (data.get("usage") or {}).get("completion_tokens")
        except (KeyError, IndexError, TypeError):
            return out | {"outcome": "error", "detail": "malformed response"}
        if out["finish_reason"] == "length":
            return out | {"outcome": "truncated"}
        outcome, why = await asyncio.to_thread(check_output, schema, text)
        return out | {"outcome": outcome, "detail": why, "text": text[:400] if outcome != "valid" else None}
    if status == 400 and "max_tokens was reached" in msg:
        return out | {"outcome": "truncated"}
    err = data.get("error") if isinstance(data.get("error"), dict) else {}
    if status == 500 and (err.get("type") == "invalid_output" or "does not satisfy the schema" in msg
                          or "output is not valid JSON" in msg):
        return out | {"outcome": "rejected_output", "detail": msg[:300]}
    reason = "timeout" if msg == "timeout" else msg if msg.startswith("client:") else \
        f"HTTP {status}: {refusal_reason(msg)}"
    return out | {"outcome": "error", "detail": reason}


async def _one(http, base: str, path: Path, cfg: SchemasBenchConfig) -> dict:
    rec = {"name": path.stem, "bytes": path.stat().st_size, "status": "error", "reason": None, "message": None,
           "probe_s": None, "backend": None, "samples": []}
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return rec | {"reason": "unreadable file", "message": f"{type(e).__name__}: {str(e)[:200]}"}
    body = {"text": PROMPT.format(name=path.stem),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "json_schema": json.dumps(schema)}}
    status, headers, data, secs = await _post(http, base + "/generate", body, cfg.timeout_s)
    msg = _message(data)
    rec["probe_s"], rec["backend"] = round(secs, 4), _backend(headers, data)
    if status == 400 and "max_tokens was reached" not in msg:
        return rec | {"status": "refused", "reason": refusal_reason(msg), "message": msg[:300]}
    if status not in (200, 400):
        reason = "timeout" if msg == "timeout" else msg if msg.startswith("client:") else f"HTTP {status}"
        return rec | {"reason": reason, "message": msg[:300]}
    rec["status"] = "accepted"
    for k in range(cfg.samples):
        s = await _sample(http, base, path.stem, schema, cfg.seed + k, cfg)
        rec["samples"].append(s)
        rec["backend"] = rec["backend"] or s["backend"]
    rec["backend"] = rec["backend"] or "default"
    return rec


# ---------------------------------------------------------------- summary

def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 4)


def summarize(records: list[dict]) -> dict:
    samples = [s for r in records for s in r["samples"]]
    compile_s: dict[str, list[float]] = {}
    for r in records:
        if r["status"] == "accepted" and r["probe_s"] is not None:
            compile_s.setdefault(r["backend"] or "default", []).append(r["probe_s"])
    return {
        "schemas": len(records),
        "accepted": sum(r["status"] == "accepted" for r in records),
        "refused": sum(r["status"] == "refused" for r in records),
        "error": sum(r["status"] == "error" for r in records),
        "samples": {o: sum(s["outcome"] == o for s in samples) for o in SAMPLE_OUTCOMES},
        "resampled_samples": sum(s["resamples"] > 0 for s in samples),
        "resamples": sum(s["resamples"] for s in samples),
        "refusals": _ranked(r["reason"] for r in records if r["status"] == "refused"),
        "errors": _ranked([r["reason"] for r in records if r["status"] == "error"]
                        + [s["detail"] for s in samples if s["outcome"] == "error"]),
        "compile_s": {b: {"n": len(xs), "p50": round(statistics.median(xs), 4), "p99": _pct(xs, 0.99),
                          "max": round(max(xs), 4)} for b, xs in sorted(compile_s.items())},
        "invalid_schemas": [r["name"] for r in records if any(s["outcome"] == "invalid" for s in r["samples"])],
    }


def _ranked(items) -> dict[str, int]:
    """Counts of each item, most frequent first."""
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def format_table(summary: dict) -> str:
    s = summary
    lines = [f"schemas {s['schemas']}: accepted {s['accepted']}, refused {s['refused']}, error {s['error']}",
             "samples: " + ", ".join(f"{k} {v}" for k, v in s["samples"].items()),
             f"resampled: {s['resampled_samples']} samples ({s['resamples']} resamples)"]
    if s["refusals"]:
        lines.append("refusal reasons:")
        lines += [f"  {n:5d}  {reason}" for reason, n in s["refusals"].items()]
    if s["errors"]:
        lines.append("errors:")
        lines += [f"  {n:5d}  {reason}" for reason, n in s["errors"].items()]
    lines.append("compile (probe: first request, 1 token), seconds:")
    lines.append(f"  {'backend':12} {'n':>5} {'p50':>8} {'p99':>8} {'max':>8}")
    lines += [f"  {b:12} {c['n']:5d} {c['p50']:8.3f} {c['p99']:8.3f} {c['max']:8.3f}" for b, c in s["compile_s"].items()]
    if s["invalid_schemas"]:
        lines.append("INVALID outputs (a broken guarantee): " + ", ".join(s["invalid_schemas"]))
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point

async def bench_schemas(model: str, directory: str, cfg: SchemasBenchConfig, **stack_overrides) -> dict:
    from .common import served
    paths = sorted(Path(directory).glob("*.json"))
    if 0 < cfg.limit < len(paths):       # spread over the sorted names, so every source is sampled
        paths = [paths[i * len(paths) // cfg.limit] for i in range(cfg.limit)]
    t0 = time.perf_counter()
    async with served(model, **stack_overrides) as (_, http, base):
        gate, done = asyncio.Semaphore(cfg.concurrency), [0]

        async def guarded(p: Path) -> dict:
            async with gate:
                try:
                    rec = await _one(http, base, p, cfg)
                except Exception as e:    # never one schema's fault to end the run
                    rec = {"name": p.stem, "bytes": 0, "status": "error", "reason": f"bench: {type(e).__name__}",
                           "message": str(e)[:300], "probe_s": None, "backend": None, "samples": []}
            done[0] += 1
            outcomes = ",".join(x["outcome"] for x in rec["samples"])
            print(f"[{done[0]}/{len(paths)}] {p.stem}: {rec['status']} {rec['reason'] or outcomes}",
                  file=sys.stderr, flush=True)
            return rec
        records = await asyncio.gather(*(guarded(p) for p in paths))
    return {"model": model, "dir": str(directory), "config": asdict(cfg), "wall_s": round(time.perf_counter() - t0, 1),
            "summary": summarize(records), "schemas": records}


def run_schemas(model: str, directory: str, backend: str = "auto", json_out: str | None = None,
                cfg: SchemasBenchConfig = SchemasBenchConfig()) -> dict:
    """Run the bench, print the table, write the full result to json_out. `backend` is the grammar
    service's default engine (the stack's gr_backend: auto, xgrammar, llguidance)."""
    if not Path(directory).is_dir():
        raise SystemExit(f"bench schemas: {directory!r} is not a directory")
    out = asyncio.run(bench_schemas(model, directory, cfg, **({} if backend == "auto" else {"gr_backend": backend})))
    out["backend"] = backend
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=1)
    print(format_table(out["summary"]))
    return out
