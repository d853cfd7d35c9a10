"""`radixflow bench mixed`: what decoding requests wait while long prompts prefill.

Requests decode; a burst of long prompts arrives. Without mixed steps the engine prefills the
burst in steps of up to max_prefill_tokens and the decoding requests get no token meanwhile; with
them (mixed_chunk_tokens) the prefill is chunked and every step also carries one token of each
decoding request. Two engines of one process, rounds interleaved; reported per side: the longest
and p99 gap between a decoding request's tokens while the burst is prefilled (its inter-token
latency), the tokens those requests got meanwhile, and the wall time until everything finished.
"""
from __future__ import annotations

import random
import statistics
import time


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, min(vocab, 4000)) for _ in range(n)]


def _round(engine, r: int, decoding: int, burst: int, prompt_len: int, vocab: int) -> dict:
    from radixflow.shared.messages import ExecRequest, SamplingParams
    sp = lambda n: SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    dec = [f"{r}-d{i}" for i in range(decoding)]
    for i, rid in enumerate(dec):
        engine.add(ExecRequest(rid=rid, input_ids=_prompt(1000 * r + i, 64, vocab), sampling=sp(64)))
    for _ in range(3):                      # admitted, prefilled, decoding
        engine.step()
    last = {rid: time.perf_counter() for rid in dec}
    gaps, t0 = [], time.perf_counter()
    for i in range(burst):
        engine.add(ExecRequest(rid=f"{r}-p{i}", input_ids=_prompt(1000 * r + 500 + i, prompt_len, vocab), sampling=sp(4)))
    pending = {f"{r}-p{i}" for i in range(burst)}         # burst requests still without a first token
    done_at = float("inf")                                  # when the last of them got it
    during = 0
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter()
        for _, o in outs:
            if o.rid in pending and (o.token_ids or o.finished):
                pending.discard(o.rid)
        for _, o in outs:
            if o.rid in last and o.token_ids:
                if last[o.rid] < done_at:     # a wait that overlapped the burst's prefill
                    gaps.append(now - last[o.rid])
                    # a token from a prefill step (a decode step before the burst's admission, with
                    # overlap, is not "during" its prefill)
                    during += bool(pending) and not engine.runner.last.is_decode
                last[o.rid] = now
        if not pending and done_at == float("inf"):
            done_at = now
    wall = time.perf_counter() - t0
    gaps.sort()
    return {"itl_max_ms": gaps[-1] * 1e3 if gaps else float("nan"),
            "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else float("nan"),
            "decode_tokens_during_prefill": during, "wall_s": wall}


def run_mixed(model: str, decoding: int = 16, burst: int = 8, prompt_len: int = 1500, rounds: int = 3,
              mixed_chunk_tokens: int = 2048) -> dict:
    import json
    import os
    from radixflow.services.executor.engine import Engine, EngineConfig
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    engines = {name: Engine(EngineConfig(model=model, max_running_requests=64, burst_gap_s=0, mixed_chunk_tokens=m))
               for name, m in (("mixed", mixed_chunk_tokens), ("unmixed", 0))}
    for e in engines.values():                                           # warm up every path
        _round(e, 99, 2, 1, 256, vocab)
    res: dict[str, list[dict]] = {n: [] for n in engines}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            res[name].append(_round(engines[name], r, decoding, burst, prompt_len, vocab))
    out = {"model": model, "decoding": decoding, "burst": burst, "prompt_len": prompt_len, "rounds": rounds,
           "mixed_chunk_tokens": mixed_chunk_tokens}
    for name, rows in res.items():
        out[name] = {k: round(statistics.median(x[k] for x in rows), 3) for k in rows[0]}
        out[name]["mixed_steps"] = engines[name].mixed_steps
    out["itl_max_unmixed_over_mixed"] = round(out["unmixed"]["itl_max_ms"] / out["mixed"]["itl_max_ms"], 2)
    out["wall_mixed_over_unmixed"] = round(out["mixed"]["wall_s"] / out["unmixed"]["wall_s"], 3)
    return out
