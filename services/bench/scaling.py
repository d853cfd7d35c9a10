"""`radixflow bench scaling`: how the agent workload's wall time grows with the number of siblings
(requests sharing the preamble) and with the preamble's length, through the full service path with
the radix cache on (one stack, its cache flushed before each point), and on any OpenAI-compatible
`--against` server (its prefix cache reset through vLLM's /reset_prefix_cache where it has one).

Each point: the first request alone (it computes the preamble), then the siblings at once, as in
`bench shared-prefix`; 100-token suffixes, 8 output tokens, greedy.
"""
from __future__ import annotations

import asyncio
import json
import os

from .shared_prefix import warm_up, workload

SIBLINGS = (10, 20, 40, 80, 160)
PREAMBLES = (1000, 2000, 4000, 8000, 16000)


async def _ours(model: str, points: list[tuple[int, int]], vocab: int, dtype: str = "auto") -> list[dict]:
    from .common import Timer, generate, served
    rows = []
    async with served(model, ex_dtype=dtype) as (stack, http, base):
        await warm_up(lambda ids: generate(http, base, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}),
                      max(n for _, n in points))
        for pre_len, n in points:
            async with http.post(base + "/flush_cache", json={}) as r:
                assert r.status == 200, await r.text()
            pre, sufs = workload(pre_len, 100, n, vocab)
            body = lambda s: {"input_ids": pre + s, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                         "ignore_eos": True}}
            with Timer() as t:
                outs = [await generate(http, base, body(sufs[0]))]
                outs += await asyncio.gather(*(generate(http, base, body(s)) for s in sufs[1:]))
            prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
            cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
            rows.append({"preamble": pre_len, "siblings": n, "wall_s": round(t.s, 3),
                         "ms_per_request": round(t.s / n * 1e3, 1), "prefix_hit_rate": round(cached / prompt, 4),
                         "prefill_tokens_computed": prompt - cached})
    return rows


async def _peer(url: str, points: list[tuple[int, int]], vocab: int) -> list[dict]:
    from .shared_prefix import _peer as peer
    rows = []
    for pre_len, n in points:
        pre, sufs = workload(pre_len, 100, n, vocab)
        try:
            r = await peer(url, [(pre, sufs)], 8, True)
            rows.append({"preamble": pre_len, "siblings": n, "wall_s": r["wall_s"],
                         "ms_per_request": round(r["wall_s"] / n * 1e3, 1), "prefix_hit_rate": r["prefix_hit_rate"]})
        except Exception as e:       # a point past the peer's limits (its max model length): say so, go on
            rows.append({"preamble": pre_len, "siblings": n, "error": str(e)[:200]})
    return rows


def run_scaling(model: str, against: str | None = None, siblings=SIBLINGS, preambles=PREAMBLES,
                dtype: str = "auto", pause_peer: bool = True) -> dict:
    from .peer import describe, paused
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    points = [(3000, n) for n in siblings] + [(p, 40) for p in preambles]
    with paused(against, pause_peer) as stopped:     # a local peer: each side alone (peer.py)
        ours = asyncio.run(_ours(model, points, vocab, dtype))
    out = {"model": model, "dtype": dtype, "points": [{"preamble": p, "siblings": n} for p, n in points],
           "radixflow": ours}
    if against:
        out["against"] = {"url": against, "rows": asyncio.run(_peer(against.rstrip("/"), points, vocab)),
                          "paused_while_radixflow_ran": describe(stopped)}
        for a, b in zip(out["radixflow"], out["against"]["rows"]):
            if "wall_s" in b:
                a["radixflow_wall_over_peer"] = round(a["wall_s"] / b["wall_s"], 3)
    return out
