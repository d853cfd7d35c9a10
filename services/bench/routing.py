"""`radixflow bench routing`: placement across executors, cache-aware against round-robin.

The workload: several agent preambles (tools, instructions), each fanned out to many calls with
their own suffixes, all calls of a wave sent at once, in shuffled order; then a second wave of new
calls on the same preambles (now cached somewhere). Run through the full service path with 2-4
executors in one process, each with its own KV pool, once per policy, on a fresh stack each time.

Reported per policy and executor count: the prefix hit rate (cached / prompt tokens, from the
executors' own counters), prefill tokens computed, load balance (the busiest executor's requests
and computed prefill tokens over the mean), wall time; and the ratios cache_aware / round_robin.
Greedy outputs must be the same under both policies (the executors hold the same weights).
"""
from __future__ import annotations

import asyncio
import random

import aiohttp

from radixflow.services.stack import ORDER, Stack, stack_config
from radixflow.shared.bus import Bus
from radixflow.shared.natsd import NatsServer

from .common import Timer, generate

POLICIES = ("round_robin", "cache_aware")


def workload(preambles: int, calls: int, preamble: int, suffix: int, vocab: int, seed: int = 11):
    """Two waves of `calls` requests each per preamble, shuffled within each wave."""
    rng = random.Random(seed)
    lo, hi = 300, min(vocab, 4000) - 1
    pres = [[rng.randint(lo, hi) for _ in range(preamble)] for _ in range(preambles)]
    waves = []
    for _ in range(2):
        wave = [(p, pres[p] + [rng.randint(lo, hi) for _ in range(suffix)])
                for p in range(preambles) for _ in range(calls)]
        rng.shuffle(wave)
        waves.append(wave)
    return waves


async def _side(model: str, policy: str, executors: int, waves, out_tokens: int) -> dict:
    from radixflow.services.executor.service import ExecutorService
    with NatsServer(max_payload=8 * 1024 * 1024) as nats:
        cfg = stack_config(nats.url, model, gw_port=0, sc_routing=policy)
        stack = await Stack(cfg, names=tuple(n for n in ORDER if n != "executor")).start()
        exs: list[tuple[ExecutorService, Bus]] = []
        try:
            for i in range(executors):
                bus = Bus(f"radixflow-executor-{i}", cfg.bus)
                await bus.connect()
                ex = ExecutorService(bus, cfg.executor, cfg.service)
                await ex.start()
                exs.append((ex, bus))
            base = f"http://127.0.0.1:{stack.actors['gateway'].port}"
            sched = stack.actors["scheduler"]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
                for _ in range(1200):
                    async with http.get(base + "/health") as r:
                        if r.status == 200 and len(sched.live_executors()) == executors:
                            break
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError(f"the stack did not serve with {executors} executors in 60 s")
                before = {ex.instance: dict(ex.engine.counters) for ex, _ in exs}
                body = lambda ids: {"input_ids": ids, "sampling_params": {"max_new_tokens": out_tokens,
                                                                          "temperature": 0, "ignore_eos": True}}
                outs = []
                with Timer() as t:
                    for wave in waves:
                        outs += await asyncio.gather(*(generate(http, base, body(ids)) for _, ids in wave))
        finally:
            await stack.stop()
            for ex, bus in exs:
                await ex.drain(5)
                await ex.stop()
                await bus.close()
    per = []
    for ex, _ in exs:
        c, b = ex.engine.counters, before[ex.instance]
        d = {k: c[k] - b[k] for k in ("requests_total", "prompt_tokens_total", "cached_tokens_total")}
        per.append({"requests": d["requests_total"], "prompt_tokens": d["prompt_tokens_total"],
                    "prefill_tokens_computed": d["prompt_tokens_total"] - d["cached_tokens_total"]})
    prompt = sum(p["prompt_tokens"] for p in per)
    computed = sum(p["prefill_tokens_computed"] for p in per)

    def imbalance(key: str) -> float:
        xs = [p[key] for p in per]
        mean = sum(xs) / len(xs)
        return round(max(xs) / mean, 3) if mean else 0.0
    return {"policy": policy, "executors": executors, "wall_s": round(t.s, 3),
            "prefix_hit_rate": round(1 - computed / prompt, 4) if prompt else 0.0,
            "prefill_tokens_computed": computed, "requests_max_over_mean": imbalance("requests"),
            "prefill_max_over_mean": imbalance("prefill_tokens_computed"), "per_executor": per,
            "outputs": [o["output_ids"] for o in outs]}


def run_routing(model: str, executors: list[int], preambles: int, calls: int, preamble: int, suffix: int,
                out_tokens: int) -> dict:
    import json
    import os
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    waves = workload(preambles, calls, preamble, suffix, vocab)
    out: dict = {"model": os.path.basename(model), "preambles": preambles, "calls_per_preamble_per_wave": calls,
                 "waves": len(waves), "preamble_tokens": preamble, "suffix_tokens": suffix, "runs": []}
    for n in executors:
        sides = {p: asyncio.run(_side(model, p, n, waves, out_tokens)) for p in POLICIES}
        rr, ca = sides["round_robin"], sides["cache_aware"]
        same = rr.pop("outputs") == ca.pop("outputs")
        out["runs"] += [rr, ca]
        out[f"{n}_executors"] = {
            "hit_rate": {"round_robin": rr["prefix_hit_rate"], "cache_aware": ca["prefix_hit_rate"]},
            "prefill_computed_cache_aware_over_round_robin":
                round(ca["prefill_tokens_computed"] / rr["prefill_tokens_computed"], 3),
            "wall_cache_aware_over_round_robin": round(ca["wall_s"] / rr["wall_s"], 3),
            "requests_max_over_mean": {"round_robin": rr["requests_max_over_mean"],
                                       "cache_aware": ca["requests_max_over_mean"]},
            "greedy_outputs_identical": same}
    return out
