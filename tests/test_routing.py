"""Cache-aware placement across executors (scheduler/routing.py), without a bus."""
from __future__ import annotations

import random
import time

import pytest

from radixflow.services.scheduler.routing import BLOCK, Candidate, Router, block_hashes

rng = random.Random(7)
PRE = [[rng.randrange(3, 8000) for _ in range(3000)] for _ in range(2)]


def prompt(p: int, i: int) -> list[int]:
    return PRE[p] + [rng.randrange(3, 8000) for _ in range(100)] + [i]


def route(router: Router, reqs: list[list[int]], executors: int, cached=None) -> list[str]:
    """Place a burst: each request counts as in flight on its executor (none finishes)."""
    load = {f"e{k}": 0 for k in range(executors)}
    out = []
    for ids in reqs:
        name = router.pick([Candidate(e, (cached or {}).get(e, 0), n) for e, n in load.items()], "ns", ids)
        load[name] += 1
        out.append(name)
    return out


def test_a_burst_of_siblings_stays_together_until_its_executor_is_busy():
    r = Router("cache_aware", load_tokens=256)
    out = route(r, [prompt(0, i) for i in range(40)], executors=2)
    # the first sibling goes anywhere; the next ones follow it (its prefix is routed there) until
    # its queue costs more than the preamble (~3000 / 256 = 11-12 requests); then the other
    # executor computes the preamble once and both hold it
    first = out[0]
    run = next(i for i, e in enumerate(out) if e != first)
    assert 10 <= run <= 13, out
    counts = {e: out.count(e) for e in set(out)}
    assert len(counts) == 2 and max(counts.values()) - min(counts.values()) <= 12, counts


def test_two_preambles_split_over_two_executors():
    r = Router("cache_aware", load_tokens=256)
    reqs = [prompt(i % 2, i) for i in range(8)]        # interleaved, few enough to stay together
    out = route(r, reqs, executors=2)
    assert len({out[i] for i in range(0, 8, 2)}) == 1 and len({out[i] for i in range(1, 8, 2)}) == 1
    assert out[0] != out[1], out


def test_radix_cached_prefix_beats_an_idle_executor():
    r = Router("cache_aware", load_tokens=256)
    cands = [Candidate("hot", 2048, 3), Candidate("cold", 0, 0)]
    assert r.pick(cands, "ns", prompt(0, 1)) == "hot"
    cands = [Candidate("hot", 2048, 12), Candidate("cold", 0, 0)]     # 12 x 256 > the 2,048 it saves
    assert r.pick(cands, "other-ns", prompt(1, 1)) == "cold"


def test_namespaces_do_not_share_routed_prefixes():
    r = Router("cache_aware", load_tokens=256)
    ids = prompt(0, 1)
    r.pick([Candidate("a", 0, 0)], "alpha", ids)
    assert r.expected_cached("a", block_hashes("alpha", ids), time.monotonic()) == (len(ids) - 1) // BLOCK * BLOCK
    out = r.pick([Candidate("a", 0, 1), Candidate("b", 0, 0)], "beta", ids)
    assert out == "b"                  # beta has nothing routed anywhere: load decides


def test_round_robin_and_cache_first():
    rr = Router("round_robin")
    assert route(rr, [prompt(0, i) for i in range(6)], executors=3) == ["e0", "e1", "e2"] * 2
    cf = Router("cache_first")
    assert cf.pick([Candidate("a", 100, 50), Candidate("b", 0, 0)], "ns", prompt(0, 1)) == "a"
    with pytest.raises(ValueError):
        Router("random")
