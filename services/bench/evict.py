"""`radixflow bench evict`: admission into a full pool, where every grant evicts cached pages, with
the tree's LRU heap beside the whole-tree walk it replaced (the same tree class, its eviction
restricted to every owner, which takes the walk), on the same sequence of requests, in one run.

The cache of a server that has run a while is full, so this is every admission's cost there, and the
walk grew with the number of cached nodes (one per distinct prompt suffix)."""
from __future__ import annotations

import random
import time

from radixflow.services.radix.pool import PagePool
from radixflow.services.radix.tree import RadixTree
from radixflow.shared.messages import Candidate, RadixStep, Release


class WalkTree(RadixTree):
    """The baseline: every eviction walks the whole tree (evict restricted to all owners does), and
    no LRU heap is kept."""
    def evict(self, n_pages, owners=None, exact=False):
        return super().evict(n_pages, list(self.owner_pages) if owners is None else owners, exact)

    def _offer(self, node) -> None:
        pass


def _fill_and_admit(tree_cls, nodes: int, admissions: int, page_size: int = 16, seed: int = 0
                    ) -> tuple[float, list[int]]:
    """A pool holding `nodes` cached suffixes (under 64 shared preambles, as agent traffic leaves
    it), full; then `admissions` new requests, each granted (evicting) and released (cached)."""
    rng = random.Random(seed)
    suffix_pages, pre_pages = 2, 4
    pool = PagePool(64 * pre_pages + nodes * suffix_pages + 8, page_size)
    pool.tree = tree_cls(page_size)
    evicted: list[int] = []
    freed = pool._freed
    pool._freed = lambda ev, quota=False: (evicted.extend(ev.pages), freed(ev, quota))
    pres = [[rng.randrange(3, 30000) for _ in range(pre_pages * page_size)] for _ in range(64)]
    n = 0

    def one(rid: str) -> None:
        ids = pres[rng.randrange(64)] + [rng.randrange(3, 30000) for _ in range(suffix_pages * page_size)] + [1]
        r = pool.step(RadixStep(pool="p", budget=10**6, max_admit=1,
                                candidates=[Candidate(rid=rid, namespace="default", token_ids=ids, reserve=0)]))
        assert r.grants, r.deferred
        pool.step(RadixStep(pool="p", budget=0, max_admit=0, releases=[Release(rid=rid, computed=len(ids) - 1)]))
    while pool.free_pages >= suffix_pages + 1:
        one(f"fill{n}")
        n += 1
    evicted.clear()
    t = time.perf_counter()
    for i in range(admissions):
        one(f"r{i}")
    return (time.perf_counter() - t) / admissions, evicted


def run_evict(sizes: tuple[int, ...] = (1000, 4000, 16000), admissions: int = 300) -> dict:
    rows = []
    for nodes in sizes:
        walk, ev_w = _fill_and_admit(WalkTree, nodes, admissions)
        heap, ev_h = _fill_and_admit(RadixTree, nodes, admissions)
        assert ev_w == ev_h        # the same pages evicted, in the same order, by either
        rows.append({"cached_suffixes": nodes, "admission_ms_walk": round(walk * 1e3, 3),
                     "admission_ms_heap": round(heap * 1e3, 3), "walk_over_heap": round(walk / heap, 1),
                     "evicted_pages": len(ev_h)})
    return {"admissions_per_size": admissions, "rows": rows}
