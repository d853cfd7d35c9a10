"""PagePool: the authority over one executor pool's KV pages. Every page is in exactly one place:

    free list  |  the tree (cached, shared; evictable when unlocked)  |  private to a running request

A running request locks the deepest tree node of its cached prefix (so none of it is evicted) and
owns private pages for the rest of its prompt and its reserved output. Progress and release insert
its computed pages into the tree; pages the tree did not take are freed at release.

With cache=False (--disable-radix-cache) nothing is matched or inserted: the same engine without
sharing, the baseline every cache claim is measured against.
"""
from __future__ import annotations

from dataclasses import dataclass

from radixflow.shared.messages import (Candidate, Deferred, Grant, Progress, RadixStep, RadixStepReply,
                                       Release)

from .tree import Node, RadixTree


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(eq=False)
class Held:
    namespace: str
    tokens: list[int]
    pages: list[int]      # the request's whole page table
    node: Node            # locked: the deepest tree node of its cached / inserted prefix
    inserted: int = 0     # tokens already inserted into the tree
    computing: tuple | None = None   # the uncached page it computes first (see PagePool._next_page)


class PagePool:
    def __init__(self, num_pages: int, page_size: int, cache: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.cache = cache
        self.tree = RadixTree(page_size)
        self._free = list(range(num_pages - 1, -1, -1))
        self.held: dict[str, Held] = {}
        self.evicted_total = 0
        # first uncached page of each admitted request, until its progress puts it in the tree:
        # a later candidate with the same next page waits for that instead of computing it too
        self.computing: dict[tuple, str] = {}

    # ------------------------------------------------------------ accounting

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def private_pages(self) -> int:
        return self.num_pages - self.free_pages - self.tree.cached_pages

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            evicted = self.tree.evict(n - len(self._free))
            self.evicted_total += len(evicted)
            self._free.extend(evicted)
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def _release_pages(self, pages: list[int]) -> None:
        self._free.extend(pages)

    # ------------------------------------------------------------ the step protocol

    def step(self, msg: RadixStep) -> RadixStepReply:
        for r in msg.releases:
            self.release(r)
        for p in msg.progress:
            self.progress(p)
        grants, deferred = self.admit(msg.candidates, msg.budget, msg.max_admit)
        return RadixStepReply(grants=grants, deferred=deferred, free_pages=self.free_pages,
                              evictable_pages=self.tree.evictable_pages)

    def match_len(self, namespace: str, tokens: list[int]) -> int:
        """Cached tokens a request would reuse; at least one prompt token is always computed."""
        if not self.cache or len(tokens) <= 1:
            return 0
        return self.tree.match(namespace, tokens[:-1], split=False).length

    def admit(self, cands: list[Candidate], budget: int, max_admit: int) -> tuple[list[Grant], list[Deferred]]:
        """Longest cached prefix first (arrival order among equals), all-or-nothing per request."""
        matches = []
        for c in cands:
            m = self.tree.match(c.namespace, c.token_ids[:-1]) if self.cache and len(c.token_ids) > 1 else None
            matches.append((c, m, m.length if m else 0))
        matches.sort(key=lambda x: -x[2])
        grants: list[Grant] = []
        deferred: list[Deferred] = []
        blocked = False
        for c, m, cached in matches:
            reason = None
            nxt = self._next_page(c, cached) if self.cache else None
            extend = len(c.token_ids) - cached
            if blocked:
                reason = "memory"
            elif len(grants) >= max_admit:
                reason = "slots"
            elif grants and extend > budget:
                reason = "budget"
            elif nxt is not None and nxt in self.computing:
                reason = "shared-prefix"     # let the other compute it once; this one reuses it next step
            if reason is None:
                node = m.node if m else self.tree.root(c.namespace)
                cached_pages = m.pages if m else []
                self.tree.lock(node)
                fresh = self._alloc(pages_for(len(c.token_ids) + c.reserve, self.page_size) - len(cached_pages))
                if fresh is None:
                    self.tree.unlock(node)
                    blocked = True           # keep arrival order under memory pressure: no overtaking
                    reason = "memory"
                else:
                    self.held[c.rid] = Held(c.namespace, list(c.token_ids), cached_pages + fresh, node, cached, nxt)
                    grants.append(Grant(rid=c.rid, cached_tokens=cached, pages=cached_pages + fresh))
                    if nxt is not None:
                        self.computing[nxt] = c.rid
                    budget -= extend
            if reason is not None:
                deferred.append(Deferred(rid=c.rid, cached_tokens=cached, reason=reason))
        return grants, deferred

    def _next_page(self, c: Candidate, cached: int) -> tuple | None:
        """Two requests whose cached prefixes end at the same point and whose next page is the same
        would both compute that page (and the tree would keep only one): the second one waits a
        step and reuses it. (A longer shared prefix would have matched further, so equal cached
        lengths are the only case.)"""
        nxt = c.token_ids[cached:cached + self.page_size]
        return (c.namespace, cached, tuple(nxt)) if len(nxt) == self.page_size else None

    def progress(self, p: Progress) -> None:
        h = self.held.get(p.rid)
        if h is None or not self.cache:
            return
        self._insert(h, p.computed)

    def _insert(self, h: Held, computed: int) -> None:
        """Insert the first `computed` tokens (whole pages) and move the request's lock down to them."""
        k = min(computed, len(h.tokens)) // self.page_size * self.page_size
        if k <= h.inserted:
            return
        node = self.tree.insert(h.namespace, h.tokens[:k], h.pages[:k // self.page_size])
        self.tree.lock(node)
        self.tree.unlock(h.node)
        h.node, h.inserted = node, k
        self._done_computing(h)

    def _done_computing(self, h: Held) -> None:
        if h.computing is not None and self.computing.get(h.computing) is not None:
            del self.computing[h.computing]
        h.computing = None

    def release(self, r: Release) -> None:
        h = self.held.pop(r.rid, None)
        if h is None:
            return
        self._done_computing(h)
        h.tokens.extend(r.output_ids)
        if not self.cache:
            self.tree.unlock(h.node)
            self._release_pages(h.pages)
            return
        self._insert(h, r.computed)
        self.tree.unlock(h.node)
        # the tree keeps, for the inserted prefix, either this request's page or its own copy
        k = h.inserted // self.page_size
        kept = set(self.tree.match(h.namespace, h.tokens[:h.inserted], split=False).pages)
        self._release_pages([p for p in h.pages[:k] if p not in kept] + h.pages[k:])

    def flush(self) -> int:
        freed = self.tree.flush()
        self._release_pages(freed)
        return len(freed)

    def stats(self) -> dict[str, int]:
        return {"kv_pages_total": self.num_pages, "kv_pages_free": self.free_pages,
                "kv_pages_used": self.num_pages - self.free_pages, "kv_pages_cached": self.tree.cached_pages,
                "kv_pages_evictable": self.tree.evictable_pages, "kv_pages_private": self.private_pages,
                "evicted_pages_total": self.evicted_total, "requests_held": len(self.held)}
