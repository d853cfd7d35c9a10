"""`radixflow bench decode` and `radixflow bench latency`.

decode: tokens/s of decoding at given batch sizes, measured twice in one run: on the in-process
Engine (no bus: the baseline) and through the full service path (HTTP, NATS, every service).
latency: end-to-end time of a 1-token request through HTTP, beside the Engine's time for the same
prefill, so the ratio is what the service path costs.
"""
from __future__ import annotations

import asyncio
import random

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.shared.messages import ExecRequest, SamplingParams

from .common import Timer, generate, median, served


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 4000) for _ in range(length)] for _ in range(n)]


def engine_decode(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tok/s on the Engine: time from the step after prefill to the end, all rows together."""
    for i, p in enumerate(_prompts(batch, prompt_len, seed=batch)):
        engine.add(ExecRequest(rid=f"d{batch}-{i}", input_ids=p, eos_token_ids=[],
                               sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)))
    with Timer() as total:
        engine.step()                          # prefill of every row (max_prefill_tokens covers them)
        produced = batch
        with Timer() as dec:
            while engine.has_work():
                produced += sum(len(o.token_ids) for _, o in engine.step())
    decode_tokens = produced - batch
    return {"decode_tok_s": decode_tokens / dec.s, "total_tok_s": produced / total.s, "tokens": produced}


async def served_decode(http, base: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    bodies = [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
              for p in _prompts(batch, prompt_len, seed=batch)]
    with Timer() as t:
        outs = await asyncio.gather(*(generate(http, base, b) for b in bodies))
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"total_tok_s": produced / t.s, "tokens": produced}


def run_decode(model: str, batches: list[int], prompt_len: int, new_tokens: int) -> dict:
    engine = Engine(EngineConfig(model=model, max_running_requests=max(batches)))
    engine_decode(engine, 2, prompt_len, 8)     # warm up
    eng = {b: engine_decode(engine, b, prompt_len, new_tokens) for b in batches}
    del engine

    async def svc():
        async with served(model, ex_max_running_requests=max(batches)) as (_, http, base):
            await served_decode(http, base, 2, prompt_len, 8)
            return {b: await served_decode(http, base, b, prompt_len, new_tokens) for b in batches}
    srv = asyncio.run(svc())
    rows = []
    for b in batches:
        rows.append({"batch": b, "engine_decode_tok_s": round(eng[b]["decode_tok_s"], 1),
                     "engine_total_tok_s": round(eng[b]["total_tok_s"], 1),
                     "served_total_tok_s": round(srv[b]["total_tok_s"], 1),
                     "served_vs_engine": round(srv[b]["total_tok_s"] / eng[b]["total_tok_s"], 3)})
    return {"model": model, "prompt_len": prompt_len, "new_tokens": new_tokens, "rows": rows}


def run_latency(model: str, prompt_len: int, repeats: int) -> dict:
    engine = Engine(EngineConfig(model=model))
    prompts = _prompts(repeats + 2, prompt_len, seed=99)
    eng = []
    for i, p in enumerate(prompts):
        engine.add(ExecRequest(rid=f"l{i}", input_ids=p, eos_token_ids=[],
                               sampling=SamplingParams(max_new_tokens=1, temperature=0)))
        with Timer() as t:
            while engine.has_work():
                engine.step()
        eng.append(t.s)
    del engine

    async def svc():
        async with served(model) as (_, http, base):
            out = []
            for p in prompts:
                with Timer() as t:
                    await generate(http, base, {"input_ids": p, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                out.append(t.s)
            return out
    srv = asyncio.run(svc())
    e, s = median(eng[2:]), median(srv[2:])
    return {"model": model, "prompt_len": prompt_len, "repeats": repeats, "engine_ms": round(e * 1e3, 2),
            "served_e2e_ms": round(s * 1e3, 2), "service_path_overhead_ms": round((s - e) * 1e3, 2),
            "served_vs_engine": round(s / e, 2)}
