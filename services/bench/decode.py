"""`radixflow bench decode` and `radixflow bench latency`.

decode: tokens/s of decoding at given batch sizes, measured twice in one run: on the in-process
Engine (no bus: the baseline) and through the full service path (HTTP, NATS, every service).
`--stream`: the served requests stream (SSE, as chat clients read them), and both sides report the
inter-token latency: the engine's time per decode step, the served side's gap between a stream's
consecutive events (a token each, or several that a loop behind coalesced), p50 and p99 over every
gap of the round.
latency: end-to-end time of a 1-token request through HTTP, beside the Engine's time for the same
prefill, so the ratio is what the service path costs.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

from radixflow.services.executor.engine import Engine
from radixflow.shared.messages import ExecRequest, SamplingParams

from .common import EngineHost, Timer, generate, median, served


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 4000) for _ in range(length)] for _ in range(n)]


def engine_decode(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tok/s on the Engine: time from the step after prefill to the end, all rows together."""
    for i, p in enumerate(_prompts(batch, prompt_len, seed=batch)):
        engine.add(ExecRequest(rid=f"d{batch}-{i}", input_ids=p, eos_token_ids=[],
                               sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)))
    gaps = []
    with Timer() as total:
        engine.step()                          # prefill of every row (max_prefill_tokens covers them)
        produced = batch
        with Timer() as dec:
            while engine.has_work():
                t0 = time.perf_counter()
                produced += sum(len(o.token_ids) for _, o in engine.step())
                gaps.append(time.perf_counter() - t0)
    decode_tokens = produced - batch
    return {"decode_tok_s": decode_tokens / dec.s, "total_tok_s": produced / total.s, "tokens": produced,
            "gaps": gaps}


async def served_decode(http, base: str, batch: int, prompt_len: int, new_tokens: int, stream: bool = False) -> dict:
    bodies = [{"input_ids": p, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
               "stream": stream} for p in _prompts(batch, prompt_len, seed=batch)]
    with Timer() as t:
        outs = await asyncio.gather(*((streamed if stream else generate)(http, base, b) for b in bodies))
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"total_tok_s": produced / t.s, "tokens": produced, "gaps": [g for o in outs for g in o.get("gaps", [])],
            "events": sum(o.get("events", 0) for o in outs)}


async def streamed(http, base: str, body: dict) -> dict:
    """POST /generate with stream: the last event's body, with `gaps` (seconds between consecutive
    events after the first). Only the last event is parsed: the client shares the served side's
    process and event loop, and parsing every event would count the client's work as the server's."""
    last, gaps, at = b"", [], None
    async with http.post(base + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            if at is not None:
                gaps.append(now - at)
            at, last = now, line
    out = json.loads(last[6:])
    if "error" in out:
        raise RuntimeError(f"/generate stream: {out['error']}")
    return out | {"gaps": gaps, "events": len(gaps) + 1}


def _ms(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return round(1e3 * xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def engine_latency(engine: Engine, prompt: list[int], rid: str) -> float:
    """Seconds for a 1-token request on the Engine, from add to its output."""
    engine.add(ExecRequest(rid=rid, input_ids=prompt, eos_token_ids=[],
                           sampling=SamplingParams(max_new_tokens=1, temperature=0)))
    with Timer() as t:
        while engine.has_work():
            engine.step()
    return t.s


def run_decode(model: str, batches: list[int], prompt_len: int, new_tokens: int, rounds: int = 3,
               stream: bool = False, **overrides) -> dict:
    """Each batch size on the Engine (in a process of its own: common.EngineHost) and through the
    service path, in interleaved rounds (median of each), so a machine that speeds up or slows down
    meanwhile skews neither side."""
    with EngineHost(model, max_running_requests=max(batches)) as host:
        host.call("decode.engine_decode", 2, prompt_len, 8)     # warm up

        async def both():
            loop = asyncio.get_running_loop()
            eng = {b: [] for b in batches}
            srv = {b: [] for b in batches}
            async with served(model, ex_max_running_requests=max(batches), **overrides) as (_, http, base):
                await served_decode(http, base, 2, prompt_len, 8, stream)
                for _ in range(rounds):
                    for b in batches:
                        eng[b].append(await loop.run_in_executor(None, host.call, "decode.engine_decode", b,
                                                                 prompt_len, new_tokens))
                        srv[b].append(await served_decode(http, base, b, prompt_len, new_tokens, stream))
            return eng, srv
        eng, srv = asyncio.run(both())
    rows = []
    for b in batches:
        e_dec = median([x["decode_tok_s"] for x in eng[b]])
        e_tot = median([x["total_tok_s"] for x in eng[b]])
        s_tot = median([x["total_tok_s"] for x in srv[b]])
        row = {"batch": b, "engine_decode_tok_s": round(e_dec, 1), "engine_total_tok_s": round(e_tot, 1),
               "served_total_tok_s": round(s_tot, 1), "served_vs_engine": round(s_tot / e_tot, 3)}
        if stream:
            eg, sg = [g for x in eng[b] for g in x["gaps"]], [g for x in srv[b] for g in x["gaps"]]
            row |= {"engine_itl_p50_ms": _ms(eg, 0.5), "engine_itl_p99_ms": _ms(eg, 0.99),
                    "served_itl_p50_ms": _ms(sg, 0.5), "served_itl_p99_ms": _ms(sg, 0.99),
                    "itl_p99_served_over_engine": round(_ms(sg, 0.99) / _ms(eg, 0.99), 3),
                    # below 1: events that carried several tokens (a loop behind coalesced them)
                    "served_events_per_token": round(sum(x["events"] for x in srv[b]) / sum(x["tokens"] for x in srv[b]), 3)}
        rows.append(row)
    return {"model": model, "prompt_len": prompt_len, "new_tokens": new_tokens, "rounds": rounds, "stream": stream,
            "rows": rows}


WARM = 5


def run_latency(model: str, prompt_len: int, repeats: int) -> dict:
    """1-token requests, alternately on the Engine (its own process) and through HTTP; medians
    after WARM warm-up requests each (the served side's first few run slower)."""
    prompts = _prompts(repeats + WARM, prompt_len, seed=99)
    with EngineHost(model) as host:
        async def both():
            loop = asyncio.get_running_loop()
            eng, srv = [], []
            async with served(model) as (_, http, base):
                for i, p in enumerate(prompts):
                    eng.append(await loop.run_in_executor(None, host.call, "decode.engine_latency", p, f"l{i}"))
                    with Timer() as t:
                        await generate(http, base, {"input_ids": p, "sampling_params": {"max_new_tokens": 1,
                                                                                        "temperature": 0}})
                    srv.append(t.s)
            return eng, srv
        eng, srv = asyncio.run(both())
    e, s = median(eng[WARM:]), median(srv[WARM:])
    return {"model": model, "prompt_len": prompt_len, "repeats": repeats, "engine_ms": round(e * 1e3, 2),
            "served_e2e_ms": round(s * 1e3, 2), "service_path_overhead_ms": round((s - e) * 1e3, 2),
            "served_vs_engine": round(s / e, 2)}
