"""`radixflow bench structured`: what structured output costs.

1. compile: a medium schema compiled cold, then served from the cache (the time inside the grammar
   service, and through the bus), for the same schema reformatted;
2. decode: tokens/s at batch 16 with a JSON schema vs unconstrained, counted over the steps in
   which all 16 rows are running (so early finishers do not skew either side); the constrained
   side with and without jump-forward decoding (executor/jump.py: policy auto, and beside it all
   and certain), on engines of one process; forced text spelled as the tokenizer spells it (the
   default), and beside it as the model likes (executor/spelling.py).
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

# drafts of at most 4 tokens: with the tokenizer's spelling most forced tokens are certain (never
# undone), and a longer draft adds rows only where the forced text is longer (little gain past 4)
JUMP_FORWARD = 4

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


def _decode(model: str, blob: bytes, batch: int, new_tokens: int, rounds: int) -> dict:
    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.services.grammar.backends import make
    from radixflow.shared.messages import ExecRequest, SamplingParams
    grammar = make("xgrammar", model).load(zlib.decompress(blob))
    mk = lambda jf, policy="auto", spelling="tokenizer": Engine(EngineConfig(
        model=model, max_running_requests=batch, burst_gap_s=0, jump_forward=jf, jump_forward_policy=policy,
        forced_spelling=spelling))
    plain, jumping, every, sure = mk(0), mk(JUMP_FORWARD), mk(JUMP_FORWARD, "all"), mk(JUMP_FORWARD, "certain")
    # beside them, forced text spelled as the model likes (forced_spelling=model): other outputs,
    # so its jump-forward is compared with its own constrained side
    plain_m, jumping_m = mk(0, spelling="model"), mk(JUMP_FORWARD, spelling="model")

    def run(engine: Engine, constrained: bool) -> tuple[float, float]:
        """tokens/s over the steps in which all rows run, and tokens per such step per row."""
        for i in range(batch):
            engine.add(ExecRequest(rid=f"{constrained}-{i}", input_ids=[300 + i, 301, 302, 303], eos_token_ids=[2, 0],
                                   sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.7, seed=i,
                                                           ignore_eos=not constrained)),
                       grammar if constrained else None)
        engine.step()                                     # prefill
        full_steps, full_time, full_tokens = 0, 0.0, 0
        while engine.has_work():
            full = engine.num_running == batch
            t0 = time.perf_counter()
            outs = engine.step()
            if full:
                full_steps += 1
                full_time += time.perf_counter() - t0
                full_tokens += sum(len(o.token_ids) for _, o in outs)
        if not full_time:
            return float("nan"), float("nan")
        return full_tokens / full_time, full_tokens / full_steps / batch

    for e in (plain, jumping, every, sure, plain_m, jumping_m):       # warm up every path
        run(e, False)
        run(e, True)
    # interleaved rounds, so that a machine slowing down or speeding up meanwhile skews no side; the
    # ratios are the medians of each round's own (paired) ratios, steadier than a ratio of medians
    # where the machine's speed drifts by tens of percent from one round to the next
    frees, constraineds, jf, certain, alls, constraineds_m, jf_m = [], [], [], [], [], [], []
    for _ in range(rounds):
        frees.append(run(plain, False)[0])
        constraineds.append(run(plain, True)[0])
        jf.append(run(jumping, True))
        certain.append(run(sure, True)[0])
        alls.append(run(every, True)[0])
        constraineds_m.append(run(plain_m, True)[0])
        jf_m.append(run(jumping_m, True)[0])
    free, constrained = statistics.median(frees), statistics.median(constraineds)
    jf_tok_s = statistics.median(r[0] for r in jf)
    st = jumping.stats()

    def paired(a: list[float], b: list[float]) -> float:
        return round(statistics.median(x / y for x, y in zip(a, b)), 3)
    jfs = [r[0] for r in jf]
    return {"batch": batch, "rounds": rounds, "unconstrained_tok_s": round(free, 1), "json_schema_tok_s": round(constrained, 1),
            "constrained_vs_unconstrained": paired(constraineds, frees),
            "json_schema_jump_forward_tok_s": round(jf_tok_s, 1),
            "jump_forward_vs_unconstrained": paired(jfs, frees),
            "jump_forward_vs_constrained": paired(jfs, constraineds),
            "jump_forward_tokens_per_row_step": round(statistics.median(r[1] for r in jf), 3),
            "jump_forward_max_draft": JUMP_FORWARD, "jump_forward_drafted": st["jump_forward_drafted_total"],
            "jump_forward_kept": st["jump_forward_kept_total"], "jump_forward_certain": st["jump_forward_certain_total"],
            "jump_forward_policy": "auto", "jump_forward_auto_unsure_keep_rate": round(
                jumping.runner.unsure[1] / max(jumping.runner.unsure[0], 1), 3),
            "jump_forward_auto_draft_row_cost": round(jumping._row_cost or 0.0, 3),
            # the fixed policies beside it: every forced token; only those the grammar alone allows
            # (never undone, never sampled)
            "jump_forward_all_vs_constrained": paired(alls, constraineds),
            "jump_forward_certain_vs_constrained": paired(certain, constraineds),
            "jump_forward_certain_drafted": sure.stats()["jump_forward_drafted_total"],
            "forced_spelling": "tokenizer",
            # forced_spelling=model: constrained vs unconstrained, and its auto jump-forward vs it
            "model_spelling_constrained_vs_unconstrained": paired(constraineds_m, frees),
            "model_spelling_jump_forward_vs_constrained": paired(jf_m, constraineds_m)}


def run_structured(model: str, repeats: int = 200, batch: int = 16, new_tokens: int = 256, rounds: int = 5) -> dict:
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
    return {"model": model, "compile": compile_stats, "decode": _decode(model, blob, batch, new_tokens, rounds)}
