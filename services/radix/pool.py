"""PagePool: the authority over one executor pool's KV pages and, for hybrid models, its state
slots. Every page and every slot is in exactly one place:

    pages:  free list  |  the tree (cached, shared)  |  private to a running request
    slots:  free list  |  a tree node's checkpoint   |  a running request's working / tail / planned

A running request locks the deepest tree node of its KV match (so none of it, nor the checkpoints on
that path, is evicted) and owns private pages for the rest of its prompt and reserved output.
Progress and release insert its computed pages into the tree; pages the tree did not take are
freed at release.

Hybrid models: a prefix is resumable only from a node that carries a state (the DeltaNet state after
that node's last token). A request resumes from the deepest one on its match and recomputes the KV
after it; its grant plans checkpoints where reuse will happen: the branching point (where its KV
match ends, so the next sibling resumes exactly there), every `checkpoint_interval` tokens, and the
last page boundary of its prompt. During decode the executor keeps a tail checkpoint at the latest
page boundary, inserted at release (the next turn of a conversation resumes from it).

Programs pin a fork point: a request released with `pin` keeps its inserted prefix locked under
that key until RadixStep.unpins names it (its children have all been admitted and lock the path
themselves; the scheduler's CacheHints reach radix through the executor) or the pin's deadline. A cancelled branch (`discard`) and a lost select choice (`demote`) have their
private pages marked oldest in the LRU: the first to go under memory pressure.

Page quotas (Candidate.quota_pages > 0) keep one tenant's load from evicting another tenant's hot
prefixes. They count, per owner (the scope before a namespace's first "/"), the pages its
namespaces keep in the tree:
- a candidate whose owner is at its quota and needs more pages than are free evicts the owner's
  own least recent unlocked leaves first: what it will cache replaces what it cached before;
- a release that leaves its owner over quota evicts the owner's own LRU leaves down to the quota;
- hybrid: a candidate with a quota short of state slots drops its owner's own checkpoints first.
So an owner with a quota keeps beyond it only what its running requests and pins lock (trimmed at
its next release), and others' pages go only under global pressure: from owners without a quota
(plain LRU, as without quotas), or when an owner with one needs more than the free pages plus its
own unlocked cache (its requests' private pages, which the scheduler's per-tenant limits bound).
Deferring it instead could wait forever: its remaining pages may be locked by the very prefix it
matched.

With cache=False (--disable-radix-cache) nothing is matched or inserted: the same engine without
sharing, the baseline every cache claim is measured against.
"""
from __future__ import annotations

import heapq
from collections import deque

import msgspec

from radixflow.shared.messages import (Candidate, Deferred, Grow, HeldPages, Progress, RadixStep, RadixStepReply,
                                       Release)

from .admission import Admission
from .held import Held
from .pins import Pins
from .tiered import TierIndex
from .tree import Evicted, Node, RadixTree, owner_of


class PagePool(Admission, Pins):
    def __init__(self, num_pages: int, page_size: int, cache: bool = True, num_state_slots: int = 0,
                 checkpoint_interval: int = 0, tier_root: bytes = b"", tier_load_pages: int = 0):
        self.num_pages = num_pages
        self.page_size = page_size
        self.cache = cache
        self.tree = RadixTree(page_size)
        # a min-heap: allocation takes the lowest free pages, so a request's fresh pages (and a
        # prefix it caches) form contiguous runs when memory allows, which the executor reads as
        # views instead of gathering them (runner.shared_prefixes)
        self._free = list(range(num_pages))
        self.peak_used = 0               # most pages out of the free list at once (bench shared-prefix)
        self.num_state_slots = num_state_slots
        self.hybrid = num_state_slots > 0
        self.interval = checkpoint_interval // page_size * page_size
        self._free_states = list(range(num_state_slots - 1, -1, -1))
        self.held: dict[str, Held] = {}
        # first uncached page of each admitted request, until its progress puts it in the tree:
        # a later candidate with the same next page waits for that instead of computing it too
        self.computing: dict[tuple, str] = {}
        self.pins: dict[str, tuple[Node, float]] = {}     # key -> (locked node, monotonic deadline)
        self._kept: dict[str, list[int]] = {}             # rid -> prompt: last step's deferred candidates
        self._unpinned: deque[str] = deque(maxlen=4096)   # unpinned before their release arrived
        self.tiered = TierIndex(tier_root, page_size, self.hybrid, tier_load_pages)   # what the executor's KV tiers hold
        self.counters = {"evicted_pages_total": 0, "state_checkpoints_total": 0, "state_restores_total": 0,
                         "state_recomputed_tokens_total": 0, "evicted_states_total": 0,
                         "quota_evicted_pages_total": 0}

    # ------------------------------------------------------------ accounting

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def private_pages(self) -> int:
        return self.num_pages - self.free_pages - self.tree.cached_pages

    def _freed(self, ev: Evicted, quota: bool = False) -> None:
        self._release_pages(ev.pages)
        self._free_states.extend(ev.states)
        self.counters["evicted_pages_total"] += len(ev.pages)
        self.counters["evicted_states_total"] += len(ev.states)
        if quota:
            self.counters["quota_evicted_pages_total"] += len(ev.pages)

    def _alloc(self, n: int, namespace: str = "", quota: int = 0) -> list[int] | None:
        owner = owner_of(namespace)
        if n > len(self._free) and quota > 0 and self.tree.owner_pages.get(owner, 0) >= quota:
            self._freed(self.tree.evict(n - len(self._free), [owner]), quota=True)
        if n > len(self._free):
            self._freed(self.tree.evict(n - len(self._free)))
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def _alloc_states(self, n: int, namespace: str = "", quota: int = 0) -> list[int] | None:
        if n > len(self._free_states) and quota > 0:
            # hybrid: a checkpoint dropped leaves its prefix unresumable, so the same rule as for pages
            dropped = self.tree.evict_states(n - len(self._free_states), [owner_of(namespace)])
            self.counters["evicted_states_total"] += len(dropped)
            self._free_states.extend(dropped)
        if n > len(self._free_states):
            dropped = self.tree.evict_states(n - len(self._free_states))
            self.counters["evicted_states_total"] += len(dropped)
            self._free_states.extend(dropped)
        if n > len(self._free_states):
            return None
        return [self._free_states.pop() for _ in range(n)]

    def adopt(self, held: list[HeldPages]) -> None:
        """A fresh pool learns what an executor's running requests hold (radix restarted under
        them): their pages and slots leave the free lists, and each request's computed prefix is
        cached again and locked as if its progress had just arrived. The old tree's other pages and
        checkpoints are forgotten: free. A prefix is resumable only from the checkpoints re-made
        here (checkpoints still ahead of a request, tails at release), never from a state it did
        not see. A checkpoint already behind a request is not taken back: the old pool either gave
        its slot to the tree or freed it (and may have handed it to another request since), and the
        executor cannot tell which; its prefix is cached without that state."""
        def ahead(a: HeldPages) -> dict[int, int]:
            return {p: x for p, x in zip(a.checkpoints, a.checkpoint_slots) if p > a.computed}
        pages = {p for a in held for p in a.pages}
        slots = {x for a in held for x in (a.state_slot, a.tail_slot, *ahead(a).values()) if x >= 0}
        self._free = [p for p in self._free if p not in pages]
        heapq.heapify(self._free)
        self._free_states = [x for x in self._free_states if x not in slots]
        for a in held:
            h = Held(a.namespace, list(a.tokens), list(a.pages), self.tree.root(a.namespace), quota=a.quota_pages)
            self.tree.lock(h.node)
            if self.hybrid:
                h.working, h.tail, h.planned = a.state_slot, a.tail_slot, ahead(a)
            self.held[a.rid] = h
            if self.cache:
                self._insert(h, a.computed)

    def _release_pages(self, pages: list[int]) -> None:
        for p in pages:
            heapq.heappush(self._free, p)

    # ------------------------------------------------------------ the step protocol

    def step(self, msg: RadixStep) -> RadixStepReply:
        self.tiered.apply(msg)
        for r in msg.releases:
            self.release(r)
        for p in msg.progress:
            self.progress(p)
        self.unpin(msg.unpins)
        for d in msg.demotes:
            self.demote(d)
        # running requests before new ones: growth first, then admission from what is left
        grown, short = {}, []
        for g in msg.grows:
            pages = self.grow(g)
            if pages is None:
                short.append(g.rid)
            else:
                grown[g.rid] = pages
        cands, unknown = self._recall(msg.candidates)
        grants, deferred = self.admit(cands, msg.budget, msg.max_admit)
        prompts = {c.rid: c.token_ids for c in cands}
        self._kept = {d.rid: prompts[d.rid] for d in deferred}
        deferred += unknown
        # pages only leave the free list in admit (grants), so its high-water mark is seen here
        self.peak_used = max(self.peak_used, self.num_pages - len(self._free))
        return RadixStepReply(grants=grants, deferred=deferred, grown=grown, short=short, free_pages=self.free_pages,
                              evictable_pages=self.tree.evictable_pages)

    def _recall(self, cands: list[Candidate]) -> tuple[list[Candidate], list[Deferred]]:
        """Candidates with their prompts: those sent `known` get the one kept from the step before
        (the candidates deferred there); one this pool no longer has is deferred as "unknown", and
        the executor sends its prompt with the next step."""
        full, unknown = [], []
        for c in cands:
            if not c.known:
                full.append(c)
            elif (ids := self._kept.get(c.rid)) is not None:
                full.append(msgspec.structs.replace(c, token_ids=ids, known=False))
            else:
                unknown.append(Deferred(rid=c.rid, cached_tokens=0, reason="unknown"))
        return full, unknown

    def grow(self, g: Grow) -> list[int] | None:
        """More pages for a running request (evicting cached ones if need be); None if none can be had."""
        h = self.held.get(g.rid)
        if h is None or g.pages <= 0:
            return None
        pages = self._alloc(g.pages, h.namespace, h.quota)
        if pages is not None:
            h.pages = h.pages + pages     # a new list: in process, the grant's list is the executor's too
        return pages

    def progress(self, p: Progress) -> None:
        h = self.held.get(p.rid)
        if h is None or not self.cache:
            return
        self._insert(h, p.computed)
        self._attach_planned(h, p.computed, p.unfilled)

    def _insert(self, h: Held, computed: int) -> None:
        """Insert the first `computed` tokens (whole pages) and move the request's lock down to them."""
        k = min(computed, len(h.tokens)) // self.page_size * self.page_size
        if k <= h.inserted:
            return
        # below its own node (locked, so still in the tree and still ending at node_end): the walk
        # from the root over a 3,000-token preamble at every step's progress was most of radix's time
        start = (h.node, h.node_end) if h.node_end <= k else None
        node = self.tree.insert(h.namespace, h.tokens[:k], h.pages[:k // self.page_size], start=start)
        self.tree.lock(node)
        self.tree.unlock(h.node)
        h.node, h.inserted, h.node_end = node, k, k
        self._done_computing(h)

    def _checkpoint(self, h: Held, pos: int, slot: int) -> bool:
        """Hand `slot` (holding the state after `pos` tokens) to the tree node ending at `pos`."""
        if not 0 < pos <= h.inserted:
            return False
        node = self.tree.cut(h.node, h.node_end, pos)       # splits so that a node ends at pos
        if self.tree.set_state(node, slot):
            self.counters["state_checkpoints_total"] += 1
            return True
        return False

    def _attach_planned(self, h: Held, computed: int, unfilled: list[int] = ()) -> None:
        for pos in [p for p in h.planned if p <= computed]:
            slot = h.planned.pop(pos)
            if pos in unfilled or not self._checkpoint(h, pos, slot):
                self._free_states.append(slot)

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
            self._free_states.extend(s for s in (h.working, h.tail) if s >= 0)
            self._free_states.extend(h.planned.values())
            return
        if not r.discard:
            self._insert(h, r.computed)
        if self.hybrid:
            if not r.discard:
                self._attach_planned(h, r.computed, r.unfilled)
            self._free_states.extend(h.planned.values())
            keep_tail = r.tail > 0 and not r.discard and self._checkpoint(h, r.tail, h.tail)
            self._free_states.extend([h.working] + ([] if keep_tail else [h.tail]))
        if r.pin and not r.discard:
            self._pin(r.pin, h.node, r.pin_ttl_s)
        self.tree.unlock(h.node)
        if r.discard:
            self.tree.demote(h.node, h.keep)
        # the tree keeps, for the inserted prefix, either this request's page or its own copy
        k = h.inserted // self.page_size
        kept = set(self.tree.path_pages(h.node)[:k])
        self._release_pages([p for p in h.pages[:k] if p not in kept] + h.pages[k:])
        # only now: pages evicted before this point could be freed twice (as evicted and as not kept)
        self._trim(h)

    def _trim(self, h: Held) -> None:
        """Evict the owner's own least recent unlocked pages down to its quota."""
        owner = owner_of(h.namespace)
        over = self.tree.owner_pages.get(owner, 0) - h.quota
        if h.quota > 0 and over > 0:
            self._freed(self.tree.evict(over, [owner]), quota=True)

    def flush(self, scopes: list[str] | None = None, namespaces: list[str] | None = None) -> int:
        """Free every unlocked cached page, or only those of the namespaces these scopes own
        ("alpha" flushes "alpha" and every "alpha/<salt>"), or of these namespaces (exact, or
        prefixes ending in "*"); returns the pages freed."""
        ev = self.tree.flush(scopes or None, namespaces or ())
        self._freed(ev)
        self.counters["evicted_pages_total"] -= len(ev.pages)      # a flush is not pressure
        self.counters["evicted_states_total"] -= len(ev.states)
        return len(ev.pages)

    def placement(self, namespace: str, tokens: list[int], chains: dict | None = None) -> tuple[int, int]:
        """What a prompt would not compute here: tokens reused from the device cache, and tokens
        after them that the executor's KV tiers would load (as far as their reports say; `chains`:
        the prompt's page keys, shared by the pools of one placement)."""
        dev = self.match_len(namespace, tokens)
        return dev, (self.tiered.loadable(namespace, tokens, dev, chains) if self.cache else 0)

    def cached_by_scope(self) -> dict[str, int]:
        """Pages each owner's namespaces keep in the tree (what a page quota limits)."""
        return dict(self.tree.owner_pages)

    def stats(self) -> dict[str, int]:
        out = {"kv_pages_total": self.num_pages, "kv_pages_free": self.free_pages,
               "kv_pages_used": self.num_pages - self.free_pages, "kv_pages_cached": self.tree.cached_pages,
               "kv_pages_evictable": self.tree.evictable_pages, "kv_pages_private": self.private_pages,
               "requests_held": len(self.held), "pins": len(self.pins),
               "kv_pages_pinned": self.pinned_pages()} | self.counters \
            | (self.tiered.stats() if self.tiered.on else {})
        if self.hybrid:
            out |= {"state_slots_total": self.num_state_slots, "state_slots_free": len(self._free_states),
                    "state_slots_used": self.num_state_slots - len(self._free_states),
                    "state_slots_cached": sum(1 for n in self.tree.nodes() if n.state is not None)}
        return out
