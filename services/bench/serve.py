"""`radixflow bench serve`: load on an OpenAI-compatible /v1/completions endpoint, in the manner of
vLLM's `bench serve` and SGLang's `bench_serving`: radixflow (started in this process) and, with
`--against URL`, any other server, the same requests in one run, side by side.

Two workloads, each a sweep over load levels:
- random: prompts of random token ids (lengths uniform in [L/2, 3L/2]), outputs of a length
  uniform in [O/2, 3O/2] (ignore_eos); a level is a concurrency (closed loop: that many clients,
  each sending its next request when the last one ends);
- agent: programs arriving as a Poisson process at a level's rate (programs/s); a program is a
  preamble of one of a few tools' system prompts plus a task, fanned out to `fanout` calls that
  share it and differ in a short suffix (the agent workload of the architecture notes).

Per level: request and token throughput, TTFT, inter-token latency (per streamed chunk) and end-
to-end latency p50/p99 measured by the client, the prefix-cache hit rate (usage.prompt_tokens_details
.cached_tokens over prompt tokens) and, for radixflow, peak KV pages in use. A progress line, JSON,
and a PNG of throughput and TTFT against load (matplotlib, when installed).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class ServeConfig:
    mode: str = "random"                     # random | agent
    levels: tuple[float, ...] = (1, 4, 16)   # random: concurrency; agent: programs per second
    requests: int = 32                       # random: requests per level; agent: programs per level
    input_len: int = 256
    output_len: int = 32
    preamble: int = 1024                     # agent
    suffix: int = 64                         # agent
    fanout: int = 8                          # agent: calls per program
    tools: int = 4                           # agent: distinct preambles
    vocab: int = 4000
    seed: int = 0


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    e2e: float = math.nan
    error: str = ""


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


async def one(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    """One streamed completion; times taken at each SSE chunk that carries text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    r = Result(ok=False)
    last = None
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    r.prompt_tokens = usage.get("prompt_tokens", 0)
                    r.output_tokens = usage.get("completion_tokens", 0)
                    r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        r.error = repr(e)
        return r
    r.e2e = time.perf_counter() - t0
    r.ok = True
    return r


def _random_requests(cfg: ServeConfig, rng: random.Random) -> list[tuple[list[int], int]]:
    out = []
    for _ in range(cfg.requests):
        n = rng.randint(max(1, cfg.input_len // 2), max(1, 3 * cfg.input_len // 2))
        m = rng.randint(max(1, cfg.output_len // 2), max(1, 3 * cfg.output_len // 2))
        out.append(([rng.randrange(300, cfg.vocab) for _ in range(n)], m))
    return out


def _agent_programs(cfg: ServeConfig, rng: random.Random) -> list[list[tuple[list[int], int]]]:
    tools = [[rng.randrange(300, cfg.vocab) for _ in range(cfg.preamble)] for _ in range(cfg.tools)]
    progs = []
    for _ in range(cfg.requests):
        pre = rng.choice(tools) + [rng.randrange(300, cfg.vocab) for _ in range(cfg.suffix)]   # tool + task
        progs.append([(pre + [rng.randrange(300, cfg.vocab) for _ in range(cfg.suffix)], cfg.output_len)
                      for _ in range(cfg.fanout)])
    return progs


class _Progress:
    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = total, 0, label
        self.t0 = time.perf_counter()

    def tick(self) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{time.perf_counter() - self.t0:6.1f}s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run_level(http: aiohttp.ClientSession, url: str, model: str, cfg: ServeConfig, level: float,
                    label: str) -> tuple[list[Result], float]:
    rng = random.Random(cfg.seed)
    results: list[Result] = []
    t0 = time.perf_counter()
    if cfg.mode == "random":
        reqs = _random_requests(cfg, rng)
        bar = _Progress(len(reqs), label)
        queue = list(reversed(reqs))

        async def client():
            while queue:
                prompt, m = queue.pop()
                results.append(await one(http, url, model, prompt, m))
                bar.tick()
        await asyncio.gather(*(client() for _ in range(max(1, int(level)))))
    else:
        progs = _agent_programs(cfg, rng)
        bar = _Progress(len(progs) * cfg.fanout, label)
        arrivals = random.Random(cfg.seed + 1)

        async def program(calls):
            async def call(prompt, m):
                results.append(await one(http, url, model, prompt, m))
                bar.tick()
            await asyncio.gather(*(call(p, m) for p, m in calls))
        tasks = []
        for calls in progs:
            tasks.append(asyncio.create_task(program(calls)))
            await asyncio.sleep(arrivals.expovariate(level))            # Poisson arrivals
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration, 3),
            "request_throughput": round(len(ok) / duration, 3), "output_tok_s": round(out / duration, 1),
            "total_tok_s": round((prompt + out) / duration, 1),
            "ttft_ms_p50": round(_pct([r.ttft for r in ok], 50) * 1e3, 2),
            "ttft_ms_p99": round(_pct([r.ttft for r in ok], 99) * 1e3, 2),
            "itl_ms_p50": round(_pct(itl, 50) * 1e3, 2), "itl_ms_p99": round(_pct(itl, 99) * 1e3, 2),
            "e2e_ms_p50": round(_pct([r.e2e for r in ok], 50) * 1e3, 2),
            "e2e_ms_p99": round(_pct([r.e2e for r in ok], 99) * 1e3, 2),
            "cache_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else 0.0,
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


async def sweep(url: str, cfg: ServeConfig, name: str, radix=None) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async with http.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        await one(http, url, model, list(range(300, 316)), 2)                  # warm up
        rows = []
        for level in cfg.levels:
            if radix is not None:
                for p in radix.pools.values():
                    p.peak_used = p.num_pages - p.free_pages
            unit = "concurrency" if cfg.mode == "random" else "programs/s"
            results, duration = await run_level(http, url, model, cfg, level, f"{name} {unit} {level:g}")
            row = {"level": level} | summarize(results, duration)
            if radix is not None:
                pool = next(iter(radix.pools.values()))
                row |= {"peak_kv_pages": pool.peak_used, "kv_pages_total": pool.num_pages}
            rows.append(row)
    return rows


# --layout split: one prefill and one decode executor against two mixed ones, one core each
SPLIT = [{"role": "prefill", "num_threads": 1}, {"role": "decode", "kv_host_pages": 8192, "num_threads": 1}]
MIXED = [{"role": "both", "num_threads": 1}, {"role": "both", "num_threads": 1}]


async def _in_process(model: str, cfg: ServeConfig, executors: list[dict], min_tokens: int) -> tuple[list[dict], dict]:
    from .common import served_executors
    async with served_executors(model, executors, sc_disagg_min_tokens=min_tokens) as (stack, _, base, execs):
        rows = await sweep(base, cfg, "split" if executors is SPLIT else "mixed")
        return rows, stack.actors["scheduler"].disagg_counters | {
            "kv_transfer_pages": sum(e.transfer_counters["kv_transfer_pages_received_total"] for e in execs)}


def _in_processes(model: str, cfg: ServeConfig, executors: list[dict], min_tokens: int) -> tuple[list[dict], dict]:
    """Every service in its own OS process (services/cluster.py): the two executors share no GIL and
    no event loop, as on two machines."""
    from radixflow.services.cluster import Cluster, ClusterConfig
    from radixflow.shared.natsd import free_port
    env = {"RADIXFLOW_SCHEDULER_DISAGG_MIN_TOKENS": str(min_tokens)}
    label_env = {f"executor-{i}": {f"RADIXFLOW_EXECUTOR_{k.upper()}": str(v) for k, v in e.items()}
                 for i, e in enumerate(executors)}
    with Cluster(ClusterConfig(model=model, port=free_port(), counts={"executor": len(executors)}, env=env,
                               label_env=label_env)) as c:
        c.wait_ready(300, executors=len(executors))
        rows = asyncio.run(sweep(c.base, cfg, "split" if executors is SPLIT else "mixed"))
        metrics = _scrape(c.base)
    return rows, {"disagg_prefills_total": metrics.get("radixflow_disagg_prefills_total", 0),
                  "disagg_prefill_failed_total": metrics.get("radixflow_disagg_prefill_failed_total", 0),
                  "kv_transfer_pages": metrics.get("radixflow_kv_transfer_pages_received_total", 0)}


def _scrape(base: str) -> dict[str, float]:
    import urllib.request
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, val = line.rsplit(" ", 1)
            out[key.split("{")[0]] = out.get(key.split("{")[0], 0.0) + float(val)
    return out


def run_layouts(model: str, cfg: ServeConfig, min_tokens: int, processes: bool = True) -> dict:
    """The same load on two mixed executors and on a prefill + a decode executor, in one run; with
    `processes`, every service in a process of its own (else all in this one: quicker to start, but
    the executors then share one GIL and one event loop, which is not what the split is for)."""
    with open(os.path.join(model, "config.json")) as f:
        cfg.vocab = min(cfg.vocab, json.load(f)["vocab_size"])

    def layout(executors):
        if processes:
            return _in_processes(model, cfg, executors, min_tokens)
        return asyncio.run(_in_process(model, cfg, executors, min_tokens))
    mixed, _ = layout(MIXED)
    split, moved = layout(SPLIT)
    ratios = [{"level": m["level"], "itl_p99_split_over_mixed": round(s["itl_ms_p99"] / m["itl_ms_p99"], 3),
               "ttft_p50_split_over_mixed": round(s["ttft_ms_p50"] / m["ttft_ms_p50"], 3),
               "output_tok_s_split_over_mixed": round(s["output_tok_s"] / m["output_tok_s"], 3)}
              for m, s in zip(mixed, split)]
    return {"model": model, "config": cfg.__dict__ | {"levels": list(cfg.levels)}, "disagg_min_tokens": min_tokens,
            "processes": processes, "mixed": mixed, "split": split, "split_moves": moved, "ratios": ratios}


def run_serve(model: str, cfg: ServeConfig, against: str | None = None, plot: str | None = None) -> dict:
    from .common import served
    with open(os.path.join(model, "config.json")) as f:
        cfg.vocab = min(cfg.vocab, json.load(f)["vocab_size"])

    async def ours():
        async with served(model) as (stack, _, base):
            return await sweep(base, cfg, "radixflow", stack.actors["radix"])
    out = {"model": model, "config": cfg.__dict__ | {"levels": list(cfg.levels)}, "radixflow": asyncio.run(ours())}
    if against:
        out["against"] = {"url": against, "rows": asyncio.run(sweep(against, cfg, against))}
    if plot:
        out["plot"] = plot_curves(out, plot)
    return out


def plot_curves(out: dict, path: str) -> str:
    """Output tokens/s and TTFT p50/p99 against load, radixflow beside the --against server."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    unit = "concurrency" if out["config"]["mode"] == "random" else "programs/s"
    series = [("radixflow", out["radixflow"])] + ([(out["against"]["url"], out["against"]["rows"])] if "against" in out else [])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in series:
        x = [r["level"] for r in rows]
        a.plot(x, [r["output_tok_s"] for r in rows], marker="o", label=name)
        b.plot(x, [r["ttft_ms_p50"] for r in rows], marker="o", label=f"{name} p50")
        b.plot(x, [r["ttft_ms_p99"] for r in rows], marker="x", linestyle="--", label=f"{name} p99")
    a.set(xlabel=unit, ylabel="output tokens/s", title="throughput")
    b.set(xlabel=unit, ylabel="ms", title="time to first token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"radixflow bench serve ({out['config']['mode']}, {os.path.basename(out['model'])})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
