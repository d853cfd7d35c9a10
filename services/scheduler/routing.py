"""Which executor runs a request: cache-aware placement that weighs the cached prefix against load.

    cost(e) = prompt tokens e would compute  +  load_tokens x requests in flight on e

and the cheapest executor wins (Dynamo's KV router scores workers the same way: prefill blocks
to compute plus active load). A hot preamble's requests go where it is cached until that
executor's queue costs more than computing the preamble elsewhere once; then the next one goes
elsewhere, computes it, and from then on both hold it. So a preamble is not recomputed on every
executor, and no executor drowns in it.

What an executor "holds" is radix's answer (RadixPlace: the cached tokens it would reuse) or, if
more, what this router sent there moments ago: a burst of siblings arrives before the first one's
prefill is cached, and without this memory they would scatter and each executor would compute the
preamble (sgl-router keeps an approximate tree of what it routed for the same reason). That
memory is a set of chained hashes of BLOCK-token prefixes per executor, forgotten after TTL_S.

Policies: cache_aware (above), round_robin (the baseline `bench routing` measures against), and
cache_first (the longest cached prefix, then the least loaded: radixflow's placement before).
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass

BLOCK = 64             # tokens per hashed block of the routed-prefix memory
TTL_S = 60.0           # a routed prefix counts as cached there for this long (radix knows after)
MAX_BLOCKS = 200_000   # per executor: the memory's bound


def block_hashes(namespace: str, ids: list[int]) -> list[int]:
    """Chained hashes of ids[:BLOCK], ids[:2*BLOCK], ... (whole blocks only, never the last token:
    at least one prompt token is always computed)."""
    out, h = [], hash(namespace)
    for i in range(0, len(ids) - 1 - BLOCK + 1, BLOCK):
        h = hash((h, tuple(ids[i:i + BLOCK])))
        out.append(h)
    return out


@dataclass
class Candidate:
    instance: str
    cached: int            # tokens radix says it would reuse
    load: int              # requests in flight there (assigned by this scheduler, or its queue)


class Router:
    def __init__(self, policy: str = "cache_aware", load_tokens: int = 128):
        if policy not in ("cache_aware", "round_robin", "cache_first"):
            raise ValueError(f"unknown routing policy {policy!r}: cache_aware | round_robin | cache_first")
        self.policy = policy
        self.load_tokens = load_tokens
        self._routed: dict[str, OrderedDict[int, float]] = {}   # executor -> block hash -> when routed
        self._rr = itertools.count()

    def expected_cached(self, instance: str, hashes: list[int], now: float) -> int:
        """Tokens of this prompt's prefix recently routed to `instance` (whole blocks)."""
        seen = self._routed.get(instance)
        n = 0
        if seen:
            for h in hashes:
                t = seen.get(h)
                if t is None or now - t > TTL_S:
                    break
                n += 1
        return n * BLOCK

    def pick(self, cands: list[Candidate], namespace: str, ids: list[int]) -> str:
        if self.policy == "round_robin":
            choice = sorted(cands, key=lambda c: c.instance)[next(self._rr) % len(cands)].instance
            return choice
        if self.policy == "cache_first":
            return min(cands, key=lambda c: (-c.cached, c.load)).instance
        now = time.monotonic()
        hashes = block_hashes(namespace, ids)
        n = len(ids)

        def cost(c: Candidate) -> tuple[float, int]:
            cached = max(c.cached, min(self.expected_cached(c.instance, hashes, now), n - 1))
            return (n - cached) + self.load_tokens * c.load, c.load
        choice = min(cands, key=cost).instance
        self._remember(choice, hashes, now)
        return choice

    def _remember(self, instance: str, hashes: list[int], now: float) -> None:
        seen = self._routed.setdefault(instance, OrderedDict())
        for h in hashes:
            seen[h] = now
            seen.move_to_end(h)
        while len(seen) > MAX_BLOCKS:
            seen.popitem(last=False)

    def forget(self, instance: str) -> None:
        """An executor died or restarted: what was routed there is not cached there."""
        self._routed.pop(instance, None)
