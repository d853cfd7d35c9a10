"""`radixflow bench shared-prefix`: the agent workload of the architecture notes, scaled to the tiny
models. One long preamble, N requests appending different suffixes, sent concurrently, each
generating a short answer; run through the full service path with the radix cache on and with
--disable-radix-cache, in one process, side by side.

Reported per side: prefill tokens computed (prompt - cached, from each response), peak KV pages in
use (sampled from the radix service), wall time, the FLOPs of what was computed and the compute
floor they set at the GEMM peak measured on the spot (flops.py: wall_over_floor); and the ratios
off/on. Greedy outputs must match.

--engine adds the same runs on the Engine alone (no HTTP, NATS or services; common.EngineHost),
cache on and off: which part of a ratio the engine reaches, and what the service path adds to it.
"""
from __future__ import annotations

import asyncio
import random
import statistics

from radixflow.services.executor.engine import Engine
from radixflow.services.executor.models.spec import ModelSpec
from radixflow.shared.messages import ExecRequest, SamplingParams

from .common import EngineHost, Timer, encoded, generate, served
from .flops import measure_peak, request_flops
from .peer import describe, paused


def workload(preamble: int, suffix: int, n: int, vocab: int, seed: int = 7) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    lo, hi = 300, min(vocab, 4000) - 1
    pre = [rng.randint(lo, hi) for _ in range(preamble)]
    return pre, [[rng.randint(lo, hi) for _ in range(suffix)] for _ in range(n)]


def shaped(pre: list[int], sufs: list[list[int]]) -> list[list[int]]:
    """Prompts of the workload's shapes (a shared preamble as long as `pre`, suffixes as long as
    `sufs`) in token ids of their own (below the workload's range, 300+), for one untimed run before
    the timed ones, on every side: the first time a CPU server meets a batch shape it builds kernels
    for it (oneDNN's matmul primitives, a compiled graph's variant), which would slow the first timed
    run: a cost of startup, not of serving."""
    rng = random.Random(len(pre))
    own = [rng.randint(5, 299) for _ in range(len(pre))]
    return [own + [rng.randint(5, 299) for _ in s] for s in sufs]


async def warm_up(send, n: int) -> None:
    """One request alone, then n at once; 64 token ids below the workload's range (300+)."""
    await send(list(range(5, 69)))
    await asyncio.gather(*(send(list(range(5 + i % 200, 69 + i % 200))) for i in range(n)))


async def _side(model: str, runs: list, out_tokens: int, cache: bool, first_alone: bool, dtype: str = "auto") -> dict:
    """The workloads `runs` ([(preamble, suffixes)], each with a preamble of its own, so each finds a
    cold cache) one after the other on one stack; wall_s is their median."""
    async with served(model, ex_disable_radix_cache=not cache, ex_dtype=dtype) as (stack, http, base):
        radix = stack.actors["radix"]
        # warm up, identically on every side, with tokens outside the workload: first-call
        # allocations, and a burst as wide as the workload's, so that the client's connections are
        # open (a first burst that opens its connections arrives spread out and is admitted
        # piecemeal, which on a hybrid model makes a late sibling recompute the preamble)
        await warm_up(lambda ids: generate(http, base, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}),
                      len(runs[0][1]))
        # the peak of pages in use, from the pool's own high-water mark (reset below, after the
        # untimed run): a polling task here would wake the event loop every few ms and slow the
        # workload it measures
        walls, cpus, loop_cpus, outs = [], [], [], []
        for r, (pre, sufs) in enumerate(runs):
            body = lambda s: {"input_ids": pre + s, "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0,
                                                                         "ignore_eos": True}}
            bodies = encoded([body(s) for s in sufs])
            if r == 0:      # untimed, once: the workload's shapes in other token ids (shaped)
                await asyncio.gather(*(generate(http, base, b) for b in encoded([
                    {"input_ids": ids, "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0,
                                                           "ignore_eos": True}} for ids in shaped(pre, sufs)])))
                # its pages are not the workload's: flushed once its releases have reached radix
                # (an answer comes back before the executor's next exchange releases its pages)
                for _ in range(400):
                    if not any(p.held for p in radix.pools.values()):
                        break
                    await asyncio.sleep(0.005)
                async with http.post(base + "/flush_cache", json={}) as resp:
                    assert resp.status == 200, await resp.text()
                for p in radix.pools.values():
                    p.peak_used = p.num_pages - p.free_pages
                counted = dict(next(iter(radix.pools.values())).counters)   # the timed runs' counts: from here
            with Timer() as t:
                rest = bodies
                if first_alone:
                    outs.append(await generate(http, base, bodies[0]))
                    rest = bodies[1:]
                outs += await asyncio.gather(*(generate(http, base, b) for b in rest))
            walls.append(t.s)
            cpus.append(t.cpu)
            loop_cpus.append(t.thread_cpu)
        peak = max(p.peak_used for p in radix.pools.values())
        page_size = stack.cfg.executor.page_size
        pool = next(iter(radix.pools.values()))
        stats = {k: v - counted.get(k, 0) if k.endswith("_total") else v for k, v in pool.stats().items()}
        pre = runs[-1][0]
        preamble_states = [p for p in pool.tree.checkpoints_on("default", pre) if p <= len(pre)]
        async with http.get(base + "/v1/memory") as r:
            memory = (await r.json())["executors"][0]
        served_dtype = str(stack.actors["executor"].engine.runner.dtype).removeprefix("torch.")
    # per workload (the runs differ only in their token ids)
    computed = sum(o["meta_info"]["prompt_tokens"] - o["meta_info"]["cached_tokens"] for o in outs) // len(runs)
    spec = ModelSpec.from_dir(model)
    flops = sum(request_flops(spec, o["meta_info"]["prompt_tokens"], o["meta_info"]["cached_tokens"],
                              o["meta_info"]["completion_tokens"]) for o in outs) / len(runs)
    out = {"prefill_tokens_computed": computed, "peak_kv_pages": peak, "page_size": page_size,
           "wall_s": round(statistics.median(walls), 3), "wall_s_runs": [round(w, 3) for w in walls],
           # CPU seconds of this process (the stack and its client; the nats-server is another
           # process) and of its event loop (every service's handlers, and the client), medians;
           # cores_busy: how much of the machine the side kept busy (cpu_s over wall_s)
           "cpu_s": round(statistics.median(cpus), 3), "event_loop_cpu_s": round(statistics.median(loop_cpus), 3),
           "cores_busy": round(statistics.median(c / w for c, w in zip(cpus, walls)), 2),
           "gflops": round(flops / 1e9, 2), "dtype": served_dtype, "outputs": [o["output_ids"] for o in outs]}
    if pool.hybrid:
        out |= {"state_slots_holding_the_preamble": len(preamble_states), "preamble_checkpoints_at": preamble_states,
                **{k: stats[k] for k in ("state_checkpoints_total", "state_restores_total",
                                         "state_recomputed_tokens_total", "state_slots_used", "state_slots_total")},
                "memory": {k: memory[k] for k in ("kv_bytes_per_token", "kv_dtype", "state_bytes_per_sequence",
                                                  "recurrent_state_bytes_per_sequence", "conv_state_bytes_per_sequence",
                                                  "state_dtype", "kv_pages", "state_slots", "kv_pool_bytes",
                                                  "state_pool_bytes")}}
    return out


async def _peer(url: str, runs: list, out_tokens: int, first_alone: bool) -> dict:
    """The same workloads on another OpenAI-compatible server (/v1/completions with token-id
    prompts): wall time (the median over the runs), and the prefix-cache hits it reports
    (usage.prompt_tokens_details)."""
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async with http.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        async with http.post(url + "/reset_prefix_cache") as r:          # vLLM's; elsewhere a 404, harmless
            pass

        def body(prompt: list[int], max_tokens: int) -> dict:
            return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

        async def complete(data: bytes) -> dict:
            async with http.post(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}) as r:
                out = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"{url}/v1/completions {r.status}: {out}")
                return out
        await warm_up(lambda ids: complete(encoded([body(ids, 2)])[0]), len(runs[0][1]))   # as on our side
        walls, outs = [], []
        for r, (pre, sufs) in enumerate(runs):
            bodies = encoded([body(pre + s, out_tokens) for s in sufs])       # as on our side
            if r == 0:      # as on our side
                await asyncio.gather(*(complete(b) for b in encoded([body(ids, out_tokens) for ids in shaped(pre, sufs)])))
            with Timer() as t:
                rest = bodies
                if first_alone:
                    outs.append(await complete(bodies[0]))
                    rest = bodies[1:]
                outs += await asyncio.gather(*(complete(b) for b in rest))
            walls.append(t.s)
    prompt = sum(o["usage"]["prompt_tokens"] for o in outs)
    cached = sum((o["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for o in outs)
    return {"url": url, "wall_s": round(statistics.median(walls), 3), "wall_s_runs": [round(w, 3) for w in walls],
            "prefill_tokens_computed": (prompt - cached) // len(runs),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0}


def engine_run(engine: Engine, pre: list[int], sufs: list[list[int]], out_tokens: int, first_alone: bool,
               tag: str) -> dict:
    """One run of the workload on the Engine, stepped as the executor's compute thread steps it
    (run in common.EngineHost's process); its requests' ids start with `tag`."""
    sampling = SamplingParams(max_new_tokens=out_tokens, temperature=0, ignore_eos=True)
    reqs = [ExecRequest(rid=f"{tag}-{i}", input_ids=pre + s, eos_token_ids=[], sampling=sampling)
            for i, s in enumerate(sufs)]
    outs: dict[str, list[int]] = {r.rid: [] for r in reqs}
    before = dict(engine.counters)

    def until_idle() -> None:
        while engine.has_work():
            for _, o in engine.step():
                if o.error:
                    raise RuntimeError(f"{o.rid}: {o.error}")
                outs[o.rid] += o.token_ids

    with Timer() as t:
        rest = reqs
        if first_alone:
            engine.add(reqs[0])
            until_idle()
            rest = reqs[1:]
        for r in rest:
            engine.add(r)
        until_idle()
    grew = {k: engine.counters[k] - before.get(k, 0) for k in ("prompt_tokens_total", "cached_tokens_total")}
    return {"wall_s": t.s, "prefill_tokens_computed": grew["prompt_tokens_total"] - grew["cached_tokens_total"],
            "outputs": [outs[r.rid] for r in reqs]}


def _engine_side(model: str, runs: list, out_tokens: int, cache: bool, first_alone: bool, dtype: str) -> dict:
    """The runs on the Engine alone, in a process of its own (EngineHost: its thread team does not
    slow the served side's), after an untimed run of the workload's shapes as on the served side."""
    with EngineHost(model, dtype=dtype, disable_radix_cache=not cache) as host:
        n = len(runs[0][0])
        warm = shaped(*runs[0])
        host.call("shared_prefix.engine_run", warm[0][:n], [p[n:] for p in warm], out_tokens, first_alone, "warm")
        res = [host.call("shared_prefix.engine_run", pre, sufs, out_tokens, first_alone, f"run{r}")
               for r, (pre, sufs) in enumerate(runs)]
    walls = [x["wall_s"] for x in res]
    return {"prefill_tokens_computed": res[-1]["prefill_tokens_computed"], "wall_s": round(statistics.median(walls), 3),
            "wall_s_runs": [round(w, 3) for w in walls], "outputs": [o for x in res for o in x["outputs"]]}


def run_shared_prefix(model: str, preamble: int, suffix: int, n: int, out_tokens: int, first_alone: bool,
                      against: str | None = None, dtype: str = "auto", repeats: int = 3,
                      pause_peer: bool = True, engine: bool = False) -> dict:
    """Each side runs the workload `repeats` times, each time with other token ids (a cold cache:
    preamble computed once per run), and reports the median wall time: on a loaded machine one
    run's wall time moves a lot (another process's wakeups, such as an idle peer server's polling
    threads, slow the service path)."""
    import json
    import os
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    runs = [workload(preamble, suffix, n, vocab, seed=7 + r) for r in range(max(repeats, 1))]
    # a peer on this machine is paused meanwhile, so that each side has the machine to itself (peer.py)
    with paused(against, pause_peer) as stopped:
        # the compute floor: the FLOPs of what a side computed, at the GEMM peak of the dtype it served
        # in (bf16 matmuls run much faster where the CPU has AMX, and so the floor is lower), measured
        # right after each side: a shared machine's speed moves within minutes, and a side's floor is
        # set by the speed the machine had while that side ran, not by one measurement minutes from it
        on = asyncio.run(_side(model, runs, out_tokens, True, first_alone, dtype))
        on["gemm_peak_gflops"] = round(measure_peak(model, on["dtype"]) / 1e9, 1)
        off = asyncio.run(_side(model, runs, out_tokens, False, first_alone, dtype))
        off["gemm_peak_gflops"] = round(measure_peak(model, off["dtype"]) / 1e9, 1)
        eng = {cache: _engine_side(model, runs, out_tokens, cache, first_alone, on["dtype"])
               for cache in ((True, False) if engine else ())}
    for side in (on, off):
        side["floor_s"] = round(side["gflops"] / side["gemm_peak_gflops"], 3)
        side["wall_over_floor"] = round(side["wall_s"] / side["floor_s"], 2)
    peak = max(on["gemm_peak_gflops"], off["gemm_peak_gflops"])
    # the two peaks 15% apart: the machine's speed changed during the run, and so its ratios may
    # have (run it again)
    speed_varied = abs(on["gemm_peak_gflops"] - off["gemm_peak_gflops"]) > 0.15 * peak
    peer = asyncio.run(_peer(against.rstrip("/"), runs, out_tokens, first_alone)) if against else None
    outs_on, outs_off = on.pop("outputs"), off.pop("outputs")
    same = sum(a == b for a, b in zip(outs_on, outs_off))
    token_ratio = off["prefill_tokens_computed"] / max(on["prefill_tokens_computed"], 1)
    wall_ratio = off["wall_s"] / max(on["wall_s"], 1e-9)
    if peer is not None:
        prompt = n * preamble + n * suffix
        on["prefix_hit_rate"] = round(1 - on["prefill_tokens_computed"] / prompt, 4)
        peer["radixflow_wall_over_peer"] = round(on["wall_s"] / peer["wall_s"], 3)
        peer["paused_while_radixflow_ran"] = describe(stopped)
    out = {"model": model, "workload": {"preamble": preamble, "suffix": suffix, "requests": n,
                                         "output_tokens": out_tokens, "first_alone": first_alone, "runs": len(runs)},
            "dtype": on["dtype"], "gemm_peak_gflops": peak, "machine_speed_varied": speed_varied,
            "cache_on": on, "cache_off": off,
            "prefill_token_ratio": round(token_ratio, 2), "peak_pages_ratio": round(off["peak_kv_pages"] / max(on["peak_kv_pages"], 1), 2),
            "wall_speedup": round(wall_ratio, 2), "wall_speedup_over_token_ratio": round(wall_ratio / token_ratio, 3),
            # the tokens the cache saves are not all alike: a suffix token attends over the whole
            # preamble, an average preamble token over half of it, so the FLOPs saved (and the
            # speedup at equal efficiency) fall short of the token ratio
            "prefill_flop_ratio": round(off["gflops"] / max(on["gflops"], 1e-9), 2),
            "wall_speedup_over_flop_ratio": round(wall_ratio * on["gflops"] / max(off["gflops"], 1e-9), 3),
            # what the cache saves in CPU time, the work itself (the wall speedup falls short of it
            # where cache-on cannot keep every core busy)
            "cpu_ratio": round(off["cpu_s"] / max(on["cpu_s"], 1e-9), 2),
            "greedy_outputs_identical": f"{same}/{len(outs_on)}",
            # a hybrid group may pay for its branching point once (the issues' bounds, before page rounding)
            "bound_prefill_tokens": (2 if "state_slots_used" in on else 1) * preamble + n * suffix}
    if peer is not None:
        out["against"] = peer
    if engine:
        out["engine"] = _engine_summary(eng, on, off, outs_on)
    return out


def _engine_summary(eng: dict, on: dict, off: dict, outs_on: list) -> dict:
    """The Engine-alone side beside the served one: its own ratios, and what the service path adds
    (served_over_engine: the served side's wall time over the engine's, cache on and off)."""
    e_on, e_off = eng[True], eng[False]
    token_ratio = e_off["prefill_tokens_computed"] / max(e_on["prefill_tokens_computed"], 1)
    wall_ratio = e_off["wall_s"] / max(e_on["wall_s"], 1e-9)
    same = sum(a == b for a, b in zip(e_on.pop("outputs"), outs_on))
    e_off.pop("outputs")
    for side, served_side in ((e_on, on), (e_off, off)):
        # the served side's floor: the same tokens computed (checked below), the same FLOPs
        side["wall_over_floor"] = round(side["wall_s"] / served_side["floor_s"], 2)
        side["served_over_engine"] = round(served_side["wall_s"] / max(side["wall_s"], 1e-9), 3)
    return {"cache_on": e_on, "cache_off": e_off, "prefill_token_ratio": round(token_ratio, 2),
            "wall_speedup": round(wall_ratio, 2), "wall_speedup_over_token_ratio": round(wall_ratio / token_ratio, 3),
            "same_tokens_computed_as_served": e_on["prefill_tokens_computed"] == on["prefill_tokens_computed"]
            and e_off["prefill_tokens_computed"] == off["prefill_tokens_computed"],
            "greedy_outputs_identical_to_served": f"{same}/{len(outs_on)}"}
