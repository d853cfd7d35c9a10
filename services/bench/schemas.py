"""`radixflow bench schemas DIR`: every JSON Schema in DIR (*.json, one schema each) through the
whole stack as an OpenAI `response_format`, and what became of it. Two phases, so that compile
times are measured on an otherwise idle stack and not under the load of other schemas' samples:

1. probes, `probe_concurrency` schemas in flight (1 by default: each compile has the machine to
   itself): POST /generate with the schema as `json_schema`, max_new_tokens 1, streamed (the
   stream's headers come from the scheduler's acceptance, so they carry the grammar backend and
   compile time even when the 1-token output then ends in the check's "max_tokens was reached").
   Two compile figures per schema:
     compile_s   the grammar service's own time for this request (x-radixflow-grammar-compile-ms,
                 or meta_info.grammar.compile_s): lint, waiting for a worker, compile, serialize;
                 for `auto`, every engine it tried; 0 on a cache hit
     probe_s     the probe's wall time: the compile plus tokenizing, one token and HTTP
   A 400 here is a refusal, bucketed by `refusal_reason`; a probe that is cut at its one token
   (finish "length", or the check's "max_tokens was reached") means the schema compiled.
2. samples, for the accepted schemas, `concurrency` schemas in flight: POST
   /v1/chat/completions with the json_schema response_format, temperature 1.0 and seeds seed,
   seed+1, ...; each answer is one of
     valid            200, parses, and validates (jsonschema, the validator of the schema's declared
                      draft, with its format checker)
     invalid          200 but not JSON or not valid: a broken guarantee, must be 0
     truncated        finish_reason "length", or the server's 400 "max_tokens was reached"
     rejected_output  the server's own check refused its output (after any resamples): 500
     unchecked        200 but the validator itself failed (a pattern Python's re cannot compile)
     error            anything else (status, timeout), with a reason

Nothing here raises for one schema: a bad file, a timeout or a dropped connection becomes a record.
The grammar backend comes from the `x-radixflow-grammar-backend` header or meta_info.grammar,
resamples from `x-radixflow-resamples`, the compile time from `x-radixflow-grammar-compile-ms`; all
are optional ("default", 0 and None when absent).
"""
from __future__ import annotations

import asyncio
import json
import re
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
    concurrency: int = 4              # schemas sampling at once (phase 2)
    probe_concurrency: int = 1        # schemas compiling at once (phase 1): 1 times each compile alone
    seed: int = 0
    # per HTTP request: a sample that ends at max_tokens on a 248k vocabulary waits its turn among
    # `concurrency` others (a 300 s limit timed some out at concurrency 32 with Qwen3.5's tokenizer)
    timeout_s: float = 1800.0
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
    client failure. A streamed answer (text/event-stream) becomes its last event that is an error,
    else its last event, as the body."""
    t0 = time.perf_counter()
    try:
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.content_type == "text/event-stream":
                data = _last_event(await r.text())
            else:
                try:
                    data = await r.json(content_type=None)
                except ValueError:
                    data = {"error": {"message": (await r.text())[:300]}}
            return r.status, dict(r.headers), data if isinstance(data, dict) else {}, time.perf_counter() - t0
    except asyncio.TimeoutError:
        return 0, {}, {"error": {"message": "timeout"}}, time.perf_counter() - t0
    except aiohttp.ClientError as e:
        return 0, {}, {"error": {"message": f"client: {type(e).__name__}"}}, time.perf_counter() - t0


def _last_event(text: str) -> dict:
    events = []
    for line in text.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            try:
                events.append(json.loads(line[6:]))
            except ValueError:
                continue
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    return (errors or events or [{}])[-1]


def _message(data: dict) -> str:
    err = data.get("error")
    return str(err.get("message", "")) if isinstance(err, dict) else str(err or "")


def _header(headers: dict, name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _grammar_meta(data: dict) -> dict:
    meta = data.get("meta_info") if isinstance(data.get("meta_info"), dict) else {}
    return meta.get("grammar") if isinstance(meta.get("grammar"), dict) else {}


def _backend(headers: dict, data: dict) -> str | None:
    return _header(headers, "x-radixflow-grammar-backend") or _grammar_meta(data).get("backend")


def _compile_s(headers: dict, data: dict) -> float | None:
    """The grammar service's compile seconds for this request (0 on a cache hit); None from a server
    that does not report it."""
    ms = _header(headers, "x-radixflow-grammar-compile-ms")
    try:
        return float(ms) / 1000 if ms is not None else float(_grammar_meta(data)["compile_s"])
    except (KeyError, TypeError, ValueError):
        return None


def _resamples(headers: dict, data: dict) -> int:
    raw = _header(headers, "x-radixflow-resamples")
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


def _record(path: Path) -> dict:
    return {"name": path.stem, "bytes": 0, "status": "error", "reason": None, "message": None, "probe_s": None,
            "compile_s": None, "backend": None, "samples": []}


async def _probe(http, base: str, path: Path, cfg: SchemasBenchConfig) -> tuple[dict, dict | None]:
    """Phase 1 for one schema: (its record, the parsed schema when it was accepted)."""
    rec = _record(path) | {"bytes": path.stat().st_size}
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return rec | {"reason": "unreadable file", "message": f"{type(e).__name__}: {str(e)[:200]}"}, None
    body = {"text": PROMPT.format(name=path.stem), "stream": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "json_schema": json.dumps(schema)}}
    status, headers, data, secs = await _post(http, base + "/generate", body, cfg.timeout_s)
    msg = _message(data)
    rec["probe_s"], rec["backend"], rec["compile_s"] = round(secs, 4), _backend(headers, data), _compile_s(headers, data)
    if status == 400 and "max_tokens was reached" not in msg:
        return rec | {"status": "refused", "reason": refusal_reason(msg), "message": msg[:300]}, None
    if status not in (200, 400) or (msg and "max_tokens was reached" not in msg):
        # a stream that ended in an error other than the 1-token cut
        reason = "timeout" if msg == "timeout" else msg if msg.startswith("client:") else \
            f"HTTP {status}" + (f": {refusal_reason(msg)}" if msg else "")
        return rec | {"reason": reason, "message": msg[:300]}, None
    return rec | {"status": "accepted"}, schema


async def _samples(http, base: str, rec: dict, schema: dict, cfg: SchemasBenchConfig) -> None:
    """Phase 2 for one accepted schema: its samples, into rec."""
    for k in range(cfg.samples):
        s = await _sample(http, base, rec["name"], schema, cfg.seed + k, cfg)
        rec["samples"].append(s)
        rec["backend"] = rec["backend"] or s["backend"]


# ---------------------------------------------------------------- summary

def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 4)


def _spread(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99), "max": _pct(xs, 1.0)}


def summarize(records: list[dict]) -> dict:
    samples = [s for r in records for s in r["samples"]]
    service: dict[str, list[float]] = {}
    probe: dict[str, list[float]] = {}
    for r in records:
        if r["status"] != "accepted":
            continue
        backend = r["backend"] or "default"
        if r["probe_s"] is not None:
            probe.setdefault(backend, []).append(r["probe_s"])
        if r.get("compile_s") is not None:
            service.setdefault(backend, []).append(r["compile_s"])
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
        # the grammar service's own compile seconds per accepted schema (0: a cache hit), per backend
        "compile_s": {b: _spread(xs) | {"cache_hits": sum(x == 0 for x in xs)} for b, xs in sorted(service.items())},
        # the probe's wall time (compile + one token + HTTP), per backend
        "probe_s": {b: _spread(xs) for b, xs in sorted(probe.items())},
        "invalid_schemas": [r["name"] for r in records if any(s["outcome"] == "invalid" for s in r["samples"])],
    }


def _ranked(items) -> dict[str, int]:
    """Counts of each item, most frequent first."""
    out: dict[str, int] = {}
    for x in items:
        out[str(x)] = out.get(str(x), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _cells(c: dict | None) -> str:
    if not c:
        return f"{'-':>8} {'-':>8} {'-':>8}"
    return f"{c['p50']:8.3f} {c['p99']:8.3f} {c['max']:8.3f}"


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
    lines.append("compile seconds per accepted schema (compile: the grammar service's own, 0 on a cache hit; "
                 "probe: wall time of the first, 1-token request):")
    lines.append(f"  {'':24} {'compile':>26}   {'probe':>26}")
    lines.append(f"  {'backend':12} {'n':>5} {'hits':>5} {'p50':>8} {'p99':>8} {'max':>8}   "
                 f"{'p50':>8} {'p99':>8} {'max':>8}")
    for b in sorted(set(s["compile_s"]) | set(s["probe_s"])):
        c, p = s["compile_s"].get(b), s["probe_s"].get(b)
        n = (p or c)["n"]
        hits = c["cache_hits"] if c else 0
        lines.append(f"  {b:12} {n:5d} {hits:5d} {_cells(c)}   {_cells(p)}")
    if s["invalid_schemas"]:
        lines.append("INVALID outputs (a broken guarantee): " + ", ".join(s["invalid_schemas"]))
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point

async def _grammar_ready(stack, timeout_s: float = 300.0) -> None:
    """Wait for the grammar service's compile workers (they start in the background, seconds each),
    so that the first probes do not time a worker's startup as their compile."""
    grammar = stack.actors.get("grammar")
    if grammar is None:
        return
    compiler = grammar.compiler
    deadline = time.monotonic() + timeout_s
    while compiler.workers_ready < compiler.n_workers and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


def _progress(done: list[int], total: int, what: str) -> None:
    done[0] += 1
    print(f"[{done[0]}/{total}] {what}", file=sys.stderr, flush=True)


async def bench_schemas(model: str, directory: str, cfg: SchemasBenchConfig, **stack_overrides) -> dict:
    from .common import served
    paths = sorted(Path(directory).glob("*.json"))
    if 0 < cfg.limit < len(paths):       # spread over the sorted names, so every source is sampled
        paths = [paths[i * len(paths) // cfg.limit] for i in range(cfg.limit)]
    t0 = time.perf_counter()
    async with served(model, **stack_overrides) as (stack, http, base):
        await _grammar_ready(stack)
        gate, done = asyncio.Semaphore(max(1, cfg.probe_concurrency)), [0]

        async def probe(p: Path) -> tuple[dict, dict | None]:
            async with gate:
                try:
                    rec, schema = await _probe(http, base, p, cfg)
                except Exception as e:    # never one schema's fault to end the run
                    rec, schema = _record(p) | {"reason": f"bench: {type(e).__name__}", "message": str(e)[:300]}, None
            comp = "" if rec["compile_s"] is None else f" compile {rec['compile_s']:.3f}s"
            _progress(done, len(paths), f"probe {p.stem}: {rec['status']} {rec['reason'] or rec['backend']}"
                                        f"{comp} probe {rec['probe_s'] or 0:.3f}s")
            return rec, schema
        probed = await asyncio.gather(*(probe(p) for p in paths))
        t_probes = time.perf_counter() - t0

        accepted = [(rec, schema) for rec, schema in probed if schema is not None]
        gate, done = asyncio.Semaphore(max(1, cfg.concurrency)), [0]

        async def sample(rec: dict, schema: dict) -> None:
            async with gate:
                try:
                    await _samples(http, base, rec, schema, cfg)
                except Exception as e:
                    rec["samples"].append({"seed": None, "status": 0, "seconds": 0, "resamples": 0, "backend": None,
                                           "outcome": "error", "detail": f"bench: {type(e).__name__}: {str(e)[:200]}"})
            _progress(done, len(accepted), f"samples {rec['name']}: " + ",".join(x["outcome"] for x in rec["samples"]))
        if cfg.samples > 0:
            await asyncio.gather(*(sample(rec, schema) for rec, schema in accepted))
        records = [rec for rec, _ in probed]
        for rec in records:
            if rec["status"] == "accepted":
                rec["backend"] = rec["backend"] or "default"
    return {"model": model, "dir": str(directory), "config": asdict(cfg), "wall_s": round(time.perf_counter() - t0, 1),
            "probes_wall_s": round(t_probes, 1), "summary": summarize(records), "schemas": records}


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
