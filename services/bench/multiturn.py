"""`radixflow bench multiturn`: long multi-turn sessions cycling through a device pool too small for
them, with the KV tiers off and on, in one run (in the manner of SGLang's bench_multiturn).

Each session has a preamble of its own; every turn adds a user message and the model's reply (the
reply's own token ids) to its context. Turns go round the sessions, `concurrency` sessions at a
time, so between two turns of one session the others' contexts pass through the pool and push it
out. Without tiers a returning session recomputes what was evicted; with them it loads it from host
memory. Reported per layout: prefill tokens computed, the prefix hit rate (cached over prompt
tokens), and time to first token (p50, p99) over the turns after each session's first; the ratio
`ttft_p50_tiers_over_none` is the figure (goal <= 0.5), greedy outputs compared between the two.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

from .common import served
from .serve import _pct


@dataclass(frozen=True)
class MultiturnConfig:
    sessions: int = 8
    turns: int = 4
    preamble: int = 1024          # each session's own first prompt
    user: int = 64                # tokens each later turn adds before the reply
    output: int = 32              # reply tokens per turn (greedy, eos ignored)
    pool_tokens: int = 0          # the device KV pool (0: 1.25x what `concurrency` sessions reach, so the
                                  # sessions in flight fit and the others are pushed out)
    host_pages: int = 0           # the host tier in pages of 16 tokens (0: room for every session)
    concurrency: int = 2
    vocab: int = 8000

    @property
    def context(self) -> int:
        """The tokens a session reaches by its last turn."""
        return self.preamble + self.turns * (self.user + self.output)

    def sized(self) -> "MultiturnConfig":
        import dataclasses
        return dataclasses.replace(self, pool_tokens=self.pool_tokens or int(1.25 * self.concurrency * self.context),
                                   host_pages=self.host_pages or int(1.25 * self.sessions * self.context) // 16)


async def _turn(http, base: str, ids: list[int], output: int) -> dict:
    """One streamed /generate: time to the first event, and the last event's output ids and usage."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    first, last = None, b""
    async with http.post(base + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/generate {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            first = first if first is not None else time.perf_counter() - t0
            last = line
    out = json.loads(last[6:])
    if "error" in out:
        raise RuntimeError(f"/generate stream: {out['error']}")
    return {"ttft": first, "output_ids": out["output_ids"], "prompt": out["meta_info"]["prompt_tokens"],
            "cached": out["meta_info"]["cached_tokens"]}


async def _sessions(http, base: str, cfg: MultiturnConfig) -> dict:
    rng = random.Random(0)
    ctx = [[rng.randrange(300, cfg.vocab) for _ in range(cfg.preamble)] for _ in range(cfg.sessions)]
    users = [[[rng.randrange(300, cfg.vocab) for _ in range(cfg.user)] for _ in range(cfg.sessions)]
             for _ in range(cfg.turns)]
    ttft, prompt, cached, outputs = [], 0, 0, []
    for t in range(cfg.turns):
        for s0 in range(0, cfg.sessions, cfg.concurrency):
            group = range(s0, min(s0 + cfg.concurrency, cfg.sessions))
            if t:
                for s in group:
                    ctx[s] = ctx[s] + users[t][s]
            done = await asyncio.gather(*(_turn(http, base, ctx[s], cfg.output) for s in group))
            for s, d in zip(group, done):
                ctx[s] = ctx[s] + d["output_ids"]
                outputs.append(d["output_ids"])
                prompt += d["prompt"]
                cached += d["cached"]
                if t:
                    ttft.append(d["ttft"])
    return {"prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens_computed": prompt - cached,
            "prefix_hit_rate": round(cached / prompt, 4), "ttft_ms_p50": round(_pct(ttft, 50) * 1e3, 2),
            "ttft_ms_p99": round(_pct(ttft, 99) * 1e3, 2), "outputs": outputs}


async def _layout(model: str, cfg: MultiturnConfig, tiers: bool) -> dict:
    async with served(model, ex_max_total_tokens=cfg.pool_tokens, ex_kv_host_pages=cfg.host_pages if tiers else 0,
                      ex_decode_reserve=0) as (_, http, base):
        await _turn(http, base, [5] * 64, 2)          # first-call costs out of the way
        out = await _sessions(http, base, cfg)
        async with http.get(base + "/v1/memory") as r:
            mem = await r.json()
        out["tiers"] = mem["executors"][0].get("tiers", {})
        return out


def run_multiturn(model: str, cfg: MultiturnConfig = MultiturnConfig()) -> dict:
    cfg = cfg.sized()
    none = asyncio.run(_layout(model, cfg, tiers=False))
    host = asyncio.run(_layout(model, cfg, tiers=True))
    same = sum(a == b for a, b in zip(none.pop("outputs"), host.pop("outputs")))
    return {"config": asdict(cfg), "model": model, "tiers_off": none, "tiers_on": host,
            "prefill_tokens_ratio": round(host["prefill_tokens_computed"] / none["prefill_tokens_computed"], 3),
            "ttft_p50_tiers_over_none": round(host["ttft_ms_p50"] / none["ttft_ms_p50"], 3),
            "ttft_p99_tiers_over_none": round(host["ttft_ms_p99"] / none["ttft_ms_p99"], 3),
            "greedy_outputs_identical": f"{same}/{cfg.sessions * cfg.turns}"}
