"""`radixflow bench sampler`: one decode step's sampling, batched (services/executor/sampler.py)
beside the per-row loop radixflow sampled with before (filter_logits and a multinomial per row,
which is what a sampler without batching does), on the same logits, in one run.

Penalties, logit_bias and logprobs have no per-row baseline here (the loop never had them): their
rows report the batched cost beside plain greedy sampling of the same batch, i.e. what they add.
"""
from __future__ import annotations

import time

import torch

from radixflow.services.executor import sampler
from radixflow.services.executor.sequence import Sequence
from radixflow.shared.messages import SamplingParams

CASES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "temperature, seeded": dict(temperature=0.8, seed=1),
    "top_k 50, top_p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
}
EXTRAS: dict[str, dict] = {
    "greedy + logprobs (top 5)": dict(temperature=0.0, logprobs=True, top_logprobs=5),
    "greedy + 3 penalties": dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    "greedy + logit_bias (8 ids)": dict(temperature=0.0, logit_bias={i * 97: 2.0 for i in range(8)}),
}


def _seqs(batch: int, params: dict, vocab: int, out_len: int = 64) -> list[Sequence]:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(batch):
        p = SamplingParams(**params)
        if p.logit_bias:
            p.logit_bias = {t % vocab: b for t, b in p.logit_bias.items()}
        prompt = torch.randint(0, min(1000, vocab), (32,), generator=g).tolist()
        s = Sequence(rid=f"b{i}", tokens=prompt + torch.randint(0, min(1000, vocab), (out_len,), generator=g).tolist(),
                     sampling=p, eos_ids=frozenset(), prompt_len=32)
        seqs.append(s)
    return seqs


def _per_row(logits: torch.Tensor, seqs: list[Sequence], gens: list[torch.Generator]) -> list[int]:
    """The baseline: what radixflow's sampler did before it was batched."""
    out = logits.argmax(dim=-1).tolist()
    for i, s in enumerate(seqs):
        if sampler.is_greedy(s.sampling):
            continue
        probs = torch.softmax(sampler.filter_logits(logits[i], s.sampling), dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=gens[i]).item())
    return out


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_sampler(batch: int = 64, vocab: int = 151936, repeats: int = 15) -> dict:
    torch.manual_seed(0)
    logits = torch.randn(batch, vocab) * 4
    out: dict = {"batch": batch, "vocab": vocab, "repeats": repeats, "unit": "ms per step, best of repeats",
                 "cases": {}, "extras": {}}
    for name, params in CASES.items():
        seqs = _seqs(batch, params, vocab)
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        batched, loop = [], []
        for _ in range(repeats):                 # alternated, so that load on the machine hits both alike
            batched.append(_best(lambda: sampler.sample(logits.clone(), seqs), 1))
            loop.append(_best(lambda: _per_row(logits.clone(), seqs, gens), 1))
        b, lo = min(batched), min(loop)
        out["cases"][name] = {"batched_ms": round(b * 1e3, 3), "per_row_ms": round(lo * 1e3, 3),
                              "speedup": round(lo / b, 2)}
    greedy = _seqs(batch, dict(temperature=0.0), vocab)
    g = _best(lambda: sampler.sample(logits.clone(), greedy), repeats)
    for name, params in EXTRAS.items():
        seqs = _seqs(batch, params, vocab)
        t = _best(lambda: sampler.sample(logits.clone(), seqs), repeats)
        out["extras"][name] = {"batched_ms": round(t * 1e3, 3), "greedy_ms": round(g * 1e3, 3),
                               "cost_vs_greedy": round(t / g, 2)}
    return out
