"""`radixflow bench structured`: what structured output costs.

1. compile: a medium schema compiled cold, then served from the cache (the time inside the grammar
   service, and through the bus), for the same schema reformatted;
2. decode: tokens/s at batch 16 with a JSON schema vs unconstrained on the same engine, counted over
   the steps in which all 16 rows are running (so early finishers do not skew either side).
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
import zlib

MEDIUM_SCHEMA = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["search", "fetch", "calculate", "summarize", "translate"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 64},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                "filters": {"type": "array", "maxItems": 4, "items": {
                    "type": "object",
                    "properties": {"field": {"enum": ["date", "author", "lang", "site"]},
                                   "op": {"enum": ["eq", "ne", "lt", "gt"]},
                                   "value": {"type": "string", "maxLength": 24}},
                    "required": ["field", "op", "value"], "additionalProperties": False}},
                "safe": {"type": "boolean"},
            },
            "required": ["query", "limit"], "additionalProperties": False},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "notes": {"type": ["string", "null"], "maxLength": 80},
    },
    "required": ["tool", "arguments", "confidence"], "additionalProperties": False,
}

# long outputs, so that decoding (not the end of the grammar) is what is measured
DECODE_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 64, "maxItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "tag": {"enum": ["a", "b", "c"]}},
    "required": ["id", "tag"], "additionalProperties": False}}}, "required": ["rows"], "additionalProperties": False}


async def _compile(model: str, repeats: int) -> dict:
    from radixflow.services.grammar.compiler import Compiler
    c = Compiler(model, deadline_s=60, backend="xgrammar")
    await c.start()
    try:
        t0 = time.perf_counter()
        cold = await c.compile("json_schema", json.dumps(MEDIUM_SCHEMA))
        cold_s = time.perf_counter() - t0
        hits = []
        for i in range(repeats):
            spec = json.dumps(MEDIUM_SCHEMA, indent=i % 4 or None)          # reformatted: same key
            t0 = time.perf_counter()
            hit = await c.compile("json_schema", spec)
            hits.append(time.perf_counter() - t0)
            assert hit.cache_hit and hit.key == cold.key
        blob = c.fetch(cold.key).data
    finally:
        await c.stop()
    return {"cold_compile_ms": round(cold_s * 1e3, 2), "cache_hit_ms_median": round(statistics.median(hits) * 1e3, 4),
            "cache_hit_ms_p99": round(sorted(hits)[int(0.99 * (len(hits) - 1))] * 1e3, 4),
            "blob_bytes_zlib": len(blob), "blob_bytes": len(zlib.decompress(blob))}, blob


def _decode(model: str, blob: bytes, batch: int, new_tokens: int) -> dict:
    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.services.grammar.backends import make
    from radixflow.shared.messages import ExecRequest, SamplingParams
    grammar = make("xgrammar", model).load(zlib.decompress(blob))
    engine = Engine(EngineConfig(model=model, max_running_requests=batch, burst_gap_s=0))

    def run(constrained: bool) -> float:
        for i in range(batch):
            engine.add(ExecRequest(rid=f"{constrained}-{i}", input_ids=[300 + i, 301, 302, 303], eos_token_ids=[2, 0],
                                   sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.7, seed=i,
                                                           ignore_eos=not constrained)),
                       grammar if constrained else None)
        engine.step()                                     # prefill
        full_steps, full_time = 0, 0.0
        while engine.has_work():
            full = engine.num_running == batch
            t0 = time.perf_counter()
            engine.step()
            if full:
                full_steps += 1
                full_time += time.perf_counter() - t0
        return batch * full_steps / full_time if full_time else float("nan")

    run(False)                                            # warm up both paths
    run(True)
    free = statistics.median(run(False) for _ in range(3))
    constrained = statistics.median(run(True) for _ in range(3))
    return {"batch": batch, "unconstrained_tok_s": round(free, 1), "json_schema_tok_s": round(constrained, 1),
            "constrained_vs_unconstrained": round(constrained / free, 3)}


def run_structured(model: str, repeats: int = 200, batch: int = 16, new_tokens: int = 256) -> dict:
    compile_stats, _ = asyncio.run(_compile(model, repeats))

    async def decode_blob():
        from radixflow.services.grammar.compiler import Compiler
        c = Compiler(model, deadline_s=60, backend="xgrammar")
        await c.start()
        try:
            key = (await c.compile("json_schema", json.dumps(DECODE_SCHEMA))).key
            return c.fetch(key).data
        finally:
            await c.stop()
    blob = asyncio.run(decode_blob())
    return {"model": model, "compile": compile_stats, "decode": _decode(model, blob, batch, new_tokens)}
