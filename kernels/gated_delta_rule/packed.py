"""The gated delta rule over a packed prefill batch whose states live in a pool: the reference the
executor calls (kernels.dispatch), built from chunk_gated_delta_rule.

A sequence starts from its slot's state and leaves its final state there; a tap (n, dst) also
copies the state after its first n tokens to slot dst (a hybrid prefix-cache checkpoint inside
the chunk, so that a checkpoint does not cut the step).
"""
from __future__ import annotations

import torch

from ..packing import gather_rows, padded_rows, similar
from .naive import chunk_gated_delta_rule

__all__ = ["gated_delta_rule_prefill_slots"]


def gated_delta_rule_prefill_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, o: torch.Tensor, pool: torch.Tensor,
                                   bounds: list[tuple[int, int]], slots: list[int],
                                   taps: list[list[tuple[int, int]]]) -> None:
    """Sequences of a packed batch through the rule (q, k L2-normalized).

    Args:
        q, k: [T, Hk, K];  v: [T, Hv, V];  g, beta: [T, Hv]
        o: [T, Hv, V], written at each sequence's rows (others untouched)
        pool: [P, Hv, K, V] fp32, read at slots[i] and written there, and at the taps' slots
        bounds: (start, end) rows of each sequence; slots: its state slot (distinct)
        taps: per sequence [(n, dst)], 0 < n < end - start ascending: pool[dst] = its state after n tokens

    A sequence with taps runs in segments that end at them; round r runs every sequence's r-th
    segment, similar lengths in one padded call.
    """
    segs = []
    for (s, e), cuts in zip(bounds, taps):
        ends = [s + n for n, _ in cuts] + [e]
        segs.append([(a, b, dst) for a, b, dst in zip([s] + ends[:-1], ends, [d for _, d in cuts] + [-1])])
    for r in range(max((len(x) for x in segs), default=0)):
        items = [(i, segs[i][r]) for i in range(len(segs)) if r < len(segs[i])]
        lens = [b - a for _, (a, b, _) in items]
        if similar(lens):
            _padded(q, k, v, g, beta, o, pool, [(a, b) for _, (a, b, _) in items], [slots[i] for i, _ in items])
        else:
            for i, (a, b, _) in items:
                oi, final = chunk_gated_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                                                   beta[None, a:b], initial_state=pool[slots[i]][None])
                o[a:b] = oi[0]
                pool[slots[i]] = final[0]
        for i, (_, _, dst) in items:
            if dst >= 0:
                pool[dst] = pool[slots[i]]


def _padded(q, k, v, g, beta, o, pool, bounds: list[tuple[int, int]], slots: list[int]) -> None:
    """Several sequences' chunked rule as one batched call, each right-padded to the longest with
    tokens of k = v = beta = g = 0, which neither write nor decay the state: their final states are
    exactly those of their own tokens (agents' siblings have similar lengths)."""
    idx, real = padded_rows(bounds, q.shape[0], q.device)
    pad = lambda x: gather_rows(torch.cat([x, x.new_zeros(1, *x.shape[1:])]), idx)
    sl = torch.tensor(slots, device=pool.device)
    ob, final = chunk_gated_delta_rule(pad(q), pad(k), pad(v), pad(g), pad(beta), initial_state=pool[sl])
    o[idx[real]] = ob[real]
    pool[sl] = final.to(pool.dtype)
