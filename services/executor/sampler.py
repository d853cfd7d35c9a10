"""Sampling: greedy, temperature, top-k, top-p, min-p; a per-request generator makes a seeded
request reproducible whatever else shares its batch."""
from __future__ import annotations

import torch

from radixflow.shared.messages import SamplingParams


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature <= 0.0 or p.top_k == 1


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V] -> temperature-scaled logits with filtered-out tokens at -inf."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0 or p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            sp, idx = probs.sort(descending=True)
            # drop a token once the mass strictly before it already reaches top_p (the first always stays)
            drop = (sp.cumsum(-1) - sp) >= p.top_p
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] fp32 -> one token id per row."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if is_greedy(p):
            continue
        probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
