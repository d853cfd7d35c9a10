"""Admission: which waiting candidates a PagePool grants this step, and what each grant holds
(see pool.py's docstring for where pages and state slots live).

Longest usable cached prefix first, all-or-nothing per request, arrival order kept under memory
pressure. Two candidates that would compute the same next page do not both get it: the second waits
a step for the first ("shared-prefix") and reuses the page. Hybrid grants plan the state
checkpoints where reuse will happen, including where siblings of one admission part.

A mixin of PagePool (pool.py), which owns the tree, the free lists and `held`.
"""
from __future__ import annotations

from typing import Callable

from radixflow.shared.messages import Candidate, Deferred, Grant, Release

from .held import Held, pages_for
from .tree import RadixTree


class Admission:
    """Its contract with the host (PagePool): the attributes and methods annotated here."""
    cache: bool
    hybrid: bool
    page_size: int
    interval: int
    num_state_slots: int
    tree: RadixTree
    held: dict[str, Held]
    computing: dict[tuple, str]
    counters: dict[str, int]
    _free_states: list[int]
    release: Callable[[Release], None]
    _alloc: Callable[..., list[int] | None]            # (n, namespace, quota)
    _alloc_states: Callable[..., list[int] | None]     # (n, namespace, quota)
    _release_pages: Callable[[list[int]], None]

    def match_len(self, namespace: str, tokens: list[int]) -> int:
        """Cached tokens a request would reuse; at least one prompt token is always computed."""
        if not self.cache or len(tokens) <= 1:
            return 0
        m = self.tree.match(namespace, tokens[:-1], split=False)
        return m.state_len if self.hybrid else m.length

    # hybrid: checkpoints this far back from the end of a long fresh prompt (see _plan), for a prompt
    # with more than LADDER_MIN tokens to compute. An agent's siblings part a few tokens past their
    # shared preamble, often past the first one's admission (no parting point planned for them): a
    # rung every 16 tokens of the last 128 (every page at the default page size; rungs fall to page
    # boundaries) lets such a fan-out resume where it parts, in one step. The cost, a few more state
    # copies during the prompt's prefill, is paid only while slots are plentiful (_grant)
    LADDER = tuple(range(16, 129, 16)) + (256, 512, 1024, 2048)
    LADDER_MIN = 512

    def _plan(self, tokens: list[int], usable: int, kv_len: int, extra: list[int], ladder: bool = False) -> list[int]:
        """Checkpoint positions for a hybrid request resuming at `usable` whose KV match ends at
        `kv_len`: the branching point, every `interval` tokens (the chunk boundaries of a long
        prefill), the last page boundary of the prompt, and any fork points the caller asked for
        (rounded down to a page boundary: the tree holds whole pages).

        With `ladder`, also LADDER tokens back from the end. A sibling of an agent's fan-out that
        reaches radix after the first one was granted (its burst split on the way) parts from it
        where no state was planned, and without a state it resumes from the start: a second
        prefill of the whole preamble. Fan-outs part near the end of the prompt (a shared preamble,
        then each one's task), so a few states back from the end bound what such a sibling
        recomputes to about twice its own part."""
        if not self.cache:
            return []
        end = len(tokens) // self.page_size * self.page_size
        pos = {kv_len, end} | (set(range(self.interval, end + 1, self.interval)) if self.interval else set())
        pos |= {p // self.page_size * self.page_size for p in extra}
        if ladder:
            pos |= {(end - d) // self.page_size * self.page_size for d in self.LADDER}
        return sorted(p for p in pos if usable < p <= end)

    def admit(self, cands: list[Candidate], budget: int, max_admit: int) -> tuple[list[Grant], list[Deferred]]:
        """Longest usable cached prefix first (arrival order among equals), all-or-nothing per request."""
        for c in cands:
            if c.rid in self.held:
                # asked again after its grant was lost on the way (a timed-out exchange): the lost
                # grant's pages go back before it is granted anew
                self.release(Release(rid=c.rid, output_ids=[], computed=0, discard=True))
        matches = [(c, *self._match(c)) for c in cands]
        matches.sort(key=lambda x: (-x[0].priority, -x[2]))
        grants: list[Grant] = []
        deferred: list[Deferred] = []
        blocked = False
        evicted = self.counters["evicted_pages_total"]
        for c, m, cached in matches:
            if m is not None and (self.counters["evicted_pages_total"] != evicted
                                  or m.state_node is not None and m.state_node.state is None):
                # an earlier grant of this admission evicted cached pages to get its own: this
                # match may name some of them (freed, and maybe granted already), or the state
                # it would resume from: match again (only then: rematching a whole burst is not free)
                m, cached = self._match(c)
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
                part = self._parting_point(c, cached, cands) if self.hybrid and self.cache else 0
                g = self._grant(c, m, cached, nxt, part)
                if g is None:
                    blocked = True           # keep arrival order under memory pressure: no overtaking
                    reason = "memory"
                else:
                    grants.append(g)
                    budget -= extend
            if reason is not None:
                deferred.append(Deferred(rid=c.rid, cached_tokens=cached, reason=reason))
        return grants, deferred

    def _match(self, c: Candidate):
        """The tree's match for a candidate and the tokens it can reuse (hybrid: up to a checkpoint).
        At least the last prompt token is computed (its logits sample the first output token);
        prompt logprobs need the logits of every token from max_cached on."""
        limit = len(c.token_ids) - 1 if c.max_cached < 0 else min(len(c.token_ids) - 1, c.max_cached)
        m = self.tree.match(c.namespace, c.token_ids[:limit]) if self.cache and limit > 0 else None
        return m, 0 if m is None else m.state_len if self.hybrid else m.length

    def _grant(self, c: Candidate, m, cached: int, nxt: tuple | None, part: int = 0) -> Grant | None:
        node = m.node if m else self.tree.root(c.namespace)
        cached_pages = m.pages[: cached // self.page_size] if m else []
        extra = c.checkpoint_at + ([part] if part else [])
        plan = []
        if self.hybrid:
            plan = self._plan(c.token_ids, cached, m.length if m else 0, extra)
            if len(c.token_ids) - cached > self.LADDER_MIN:
                # the ladder only while state slots are plentiful: a quarter of them still free or
                # held by unlocked tree checkpoints (which the tree gives up first, and which a warm
                # pool is full of) after this grant, so that it never costs an admission
                ladder = self._plan(c.token_ids, cached, m.length if m else 0, extra, ladder=True)
                spare = len(self._free_states) + self.tree.droppable_states() - 2 - len(ladder)
                if spare > self.num_state_slots // 4:
                    plan = ladder
        self.tree.lock(node)
        fresh = self._alloc(pages_for(len(c.token_ids) + c.reserve, self.page_size) - len(cached_pages),
                            c.namespace, c.quota_pages)
        slots = self._alloc_states(2 + len(plan), c.namespace, c.quota_pages) \
            if self.hybrid and fresh is not None else []
        if fresh is None or slots is None:
            self.tree.unlock(node)
            if fresh:
                self._release_pages(fresh)
            return None
        pages = cached_pages + fresh
        h = Held(c.namespace, list(c.token_ids), pages, node, cached, cached, nxt, quota=c.quota_pages,
                 node_end=m.length if m else 0)
        g = Grant(rid=c.rid, cached_tokens=cached, pages=pages)
        if self.hybrid:
            h.working, h.tail, h.planned = slots[0], slots[1], dict(zip(plan, slots[2:]))
            g.state_slot, g.tail_slot, g.checkpoints, g.checkpoint_slots = h.working, h.tail, plan, slots[2:]
            if cached:
                g.restore_slot = m.state_node.state
                self.counters["state_restores_total"] += 1
            self.counters["state_recomputed_tokens_total"] += (m.length - cached) if m else 0
        self.held[c.rid] = h
        if nxt is not None:
            self.computing[nxt] = c.rid
        return g

    def _parting_point(self, c: Candidate, cached: int, cands: list[Candidate]) -> int:
        """Hybrid: the longest prefix `c` shares beyond `cached` with another candidate of this
        admission (0: none by a page or more). An agent's fan-out arrives together: the first
        sibling is granted and the rest wait for it to compute the preamble ("shared-prefix"). Only a
        state saved exactly where they part lets them resume there, and the tree cannot know that
        point yet (it holds no sibling): planned as a checkpoint of the first, it spares the second
        sibling recomputing the whole preamble to create it. Cheap: a candidate must first share
        the page after `cached` (a slice of one page), then bisection on slice equality (in C)."""
        a, ps = c.token_ids, self.page_size
        page = a[cached:cached + ps]
        best = 0
        if len(page) < ps:
            return 0
        for d in cands:
            b = d.token_ids
            if d is c or d.namespace != c.namespace or b[cached:cached + ps] != page:
                continue
            n = min(len(a), len(b))
            if n <= best or a[:max(best, cached) + 1] != b[:max(best, cached) + 1]:
                continue                   # parts earlier than the best so far (or before `cached`)
            lo, hi = max(best, cached) + 1, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if a[:mid] == b[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            best = lo
        return min(best, len(a) - 1)

    def _next_page(self, c: Candidate, cached: int) -> tuple | None:
        """Two requests whose cached prefixes end at the same point and whose next page is the same
        would both compute that page (and the tree would keep only one): the second one waits a
        step and reuses it. (A longer shared prefix would have matched further, so equal cached
        lengths are the only case.)"""
        nxt = c.token_ids[cached:cached + self.page_size]
        return (c.namespace, cached, tuple(nxt)) if len(nxt) == self.page_size else None
