"""Property tests of the radix cache (PagePool + RadixTree) against a brute-force oracle.

The oracle knows nothing of trees: it keeps {(namespace, page-aligned token prefix): page id} for
everything inserted, and forgets the entries whose pages the tree evicted. After every operation the
tree's content must equal the oracle's, every match must be the oracle's longest cached prefix,
locked pages must still be cached, and every page must be in exactly one place."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixflow.services.radix.pool import PagePool
from radixflow.shared.messages import Candidate, Progress, Release

NAMESPACES = ["tenant-a", "tenant-b"]
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)   # tiny alphabet: prefixes collide often


def walk_victims(tree, n_pages: int) -> list:
    """The leaves evict(n_pages) takes, in order, found as before its LRU heap: every unlocked leaf
    by a walk of the whole tree, least recent first (ties: id), a parent joining once it is a leaf."""
    import heapq
    left = {id(x): len(x.children) for x in tree.nodes()}
    heap = [(x.last_access, id(x), x) for x in tree.nodes() if not x.children and x.lock == 0]
    heapq.heapify(heap)
    out, freed = [], 0
    while heap and freed < n_pages:
        _, _, leaf = heapq.heappop(heap)
        out.append(leaf)
        freed += len(leaf.pages)
        p = leaf.parent
        if not p.is_root:
            left[id(p)] -= 1
            if left[id(p)] == 0 and p.lock == 0:
                heapq.heappush(heap, (p.last_access, id(p), p))
    return [type("Victim", (), {"pages": list(x.pages)}) for x in out]


class PoolMachine(RuleBasedStateMachine):
    PAGE = 1
    PAGES = 24

    def __init__(self):
        super().__init__()
        self.pool = PagePool(self.PAGES, self.PAGE)
        self.oracle: dict[tuple[str, tuple[int, ...]], int] = {}
        self.n = 0

    # -------------------------------------------------------------- helpers

    def tree_content(self) -> dict[tuple[str, tuple[int, ...]], int]:
        out = {}
        ps = self.PAGE
        for ns in list(self.pool.tree.roots):
            for toks, pages in self.pool.tree.sequences(ns):
                for j in range(1, len(pages) + 1):
                    out[(ns, toks[:j * ps])] = pages[j - 1]
        return out

    def oracle_match(self, ns: str, toks: list[int]) -> int:
        best, ps = 0, self.PAGE
        for j in range(1, len(toks) // ps + 1):
            if (ns, tuple(toks[:j * ps])) in self.oracle:
                best = j * ps
        return best

    def oracle_insert(self, ns: str, toks: list[int], pages: list[int]) -> None:
        ps = self.PAGE
        k = len(toks) // ps
        for j in range(1, k + 1):
            self.oracle.setdefault((ns, tuple(toks[:j * ps])), pages[j - 1])

    def track(self, op):
        """Run op; entries whose pages left the tree were evicted: the oracle forgets them."""
        before = set(self.tree_content().values())
        out = op()
        gone = before - set(self.tree_content().values())
        self.oracle = {k: v for k, v in self.oracle.items() if v not in gone}
        return out

    # -------------------------------------------------------------- operations

    @rule(ns=st.sampled_from(NAMESPACES), toks=tokens_st, reserve=st.integers(0, 6))
    def acquire(self, ns, toks, reserve):
        rid = f"r{self.n}"
        self.n += 1
        want = self.oracle_match(ns, toks[:-1])
        grants, deferred = self.track(lambda: self.pool.admit(
            [Candidate(rid=rid, namespace=ns, token_ids=toks, reserve=reserve)], budget=10**6, max_admit=8))
        if grants:
            g = grants[0]
            assert g.cached_tokens == want       # acquisition reuses exactly the longest cached prefix
            assert len(g.pages) == -(-(len(toks) + reserve) // self.PAGE)
            assert len(set(g.pages)) == len(g.pages)
        elif deferred[0].reason == "shared-prefix":
            # another held request computes the same next page right now: it will be cached soon
            assert any(h.computing is not None and h.computing[1] == want and h.namespace == ns
                       for h in self.pool.held.values())
        else:
            assert deferred[0].reason == "memory"

    @precondition(lambda self: self.pool.held)
    @rule(data=st.data())
    def progress(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pool.held)))
        h = self.pool.held[rid]
        computed = data.draw(st.integers(0, len(h.tokens)))
        ns, toks, pages = h.namespace, list(h.tokens), list(h.pages)
        self.track(lambda: self.pool.progress(Progress(rid=rid, computed=computed)))
        k = computed // self.PAGE * self.PAGE
        self.oracle_insert(ns, toks[:k], pages[:k // self.PAGE])

    @precondition(lambda self: self.pool.held)
    @rule(data=st.data(), out=st.lists(st.integers(0, 2), max_size=5))
    def release(self, data, out):
        rid = data.draw(st.sampled_from(sorted(self.pool.held)))
        h = self.pool.held[rid]
        full = h.tokens + out
        capacity = len(h.pages) * self.PAGE
        computed = data.draw(st.integers(0, min(len(full), capacity)))
        ns, pages = h.namespace, list(h.pages)
        self.track(lambda: self.pool.release(Release(rid=rid, output_ids=out, computed=computed)))
        k = computed // self.PAGE * self.PAGE
        self.oracle_insert(ns, full[:k], pages[:k // self.PAGE])

    @rule(n=st.integers(1, 10))
    def evict(self, n):
        want = [p for leaf in walk_victims(self.pool.tree, n) for p in leaf.pages]
        ev = self.track(lambda: self.pool.tree.evict(n))
        self.pool._freed(ev)
        assert ev.pages == want            # the LRU heap evicts what a walk of the whole tree would

    @rule(i=st.integers(0, 1000))
    def reuse_a_cached_path(self, i):
        """A match touches a whole cached path (a request that reuses it, then ends): its leaf is
        now the most recent, whatever the LRU heap filed for it before."""
        leaves = [n for n in self.pool.tree.nodes() if not n.children]
        if leaves:
            n, keys = leaves[i % len(leaves)], []
            while not n.is_root:
                keys.append(n.key)
                n = n.parent
            toks = [t for key in reversed(keys) for t in key]
            assert self.pool.tree.match(n.namespace, toks, split=False).length == len(toks)

    @rule(i=st.integers(0, 1000))
    def demote(self, i):
        """A cancelled branch's path goes first (release with discard does this)."""
        unlocked = [n for n in self.pool.tree.nodes() if n.lock == 0 and not n.children]
        if unlocked:
            self.pool.tree.demote(unlocked[i % len(unlocked)], 0)

    @rule()
    def flush(self):
        locked = self.locked_pages()
        self.track(self.pool.flush)
        assert self.pool.tree.cached_pages == len(locked)     # everything unlocked went

    @rule(ns=st.sampled_from(NAMESPACES), toks=tokens_st)
    def match(self, ns, toks):
        m = self.pool.tree.match(ns, toks, split=False)
        assert m.length == self.oracle_match(ns, toks)
        assert m.pages == [self.oracle[(ns, tuple(toks[:j * self.PAGE]))] for j in range(1, m.length // self.PAGE + 1)]

    # -------------------------------------------------------------- invariants

    def locked_pages(self) -> set[int]:
        out = set()
        for h in self.pool.held.values():
            n = h.node
            while n is not None:
                out.update(n.pages)
                n = n.parent
        return out

    @invariant()
    def content_equals_oracle(self):
        assert self.tree_content() == self.oracle

    @invariant()
    def locked_pages_stay_cached(self):
        cached = set(self.tree_content().values())
        assert self.locked_pages() <= cached

    @invariant()
    def every_unlocked_leaf_is_in_the_lru_heap(self):
        """...with an entry no newer than its last access (an older one is re-filed when popped)."""
        tree = self.pool.tree
        filed: dict[int, int] = {}
        for t, _, n in tree._lru:
            filed[id(n)] = min(t, filed.get(id(n), t))
        for n in tree.nodes():
            if n.lock == 0 and not n.children:
                assert id(n) in filed and filed[id(n)] <= n.last_access

    @invariant()
    def a_running_request_knows_where_its_node_ends(self):
        """Held.node ends at Held.node_end on the request's own tokens, at or past what it inserted:
        progress inserts below that node, checkpoints cut the path above it, and a release reads the
        kept pages off that path, none of them matching from the root again."""
        for h in self.pool.held.values():
            path, n = [], h.node
            while not n.is_root:
                path.append(n.key)
                n = n.parent
            toks = tuple(t for key in reversed(path) for t in key)
            assert len(toks) == h.node_end >= h.inserted
            assert toks == tuple(h.tokens[:h.node_end]) and n.namespace == h.namespace

    @invariant()
    def pages_are_conserved(self):
        pool = self.pool
        free = pool._free
        cached = set(self.tree_content().values())
        private = {p for h in pool.held.values() for p in h.pages} - cached
        assert len(free) == len(set(free))
        assert not set(free) & cached and not set(free) & private
        assert len(free) + len(cached) + len(private) == pool.num_pages
        assert pool.tree.cached_pages == len(cached)
        assert pool.free_pages + pool.private_pages + pool.tree.cached_pages == pool.num_pages
        unlocked = {p for n in pool.tree.nodes() if n.lock == 0 for p in n.pages}
        assert pool.tree.evictable_pages == len(unlocked)


class HybridMachine(PoolMachine):
    """The same, for a hybrid model: a prefix is usable only up to its deepest checkpointed state.
    The oracle keeps {(namespace, prefix): state slot} and forgets what the tree dropped."""
    PAGE = 2
    PAGES = 20
    SLOTS = 12

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.pool = PagePool(self.PAGES, self.PAGE, num_state_slots=self.SLOTS, checkpoint_interval=0)
        self.oracle, self.ostates, self.n = {}, {}, 0

    def tree_states(self):
        out = {}
        for ns, root in self.pool.tree.roots.items():
            stack = [(c, ()) for c in root.children.values()]
            while stack:
                node, toks = stack.pop()
                toks = toks + node.key
                if node.state is not None:
                    out[(ns, toks)] = node.state
                stack.extend((c, toks) for c in node.children.values())
        return out

    def track(self, op):
        before_pages = set(self.tree_content().values())
        before_states = self.tree_states()
        out = op()
        gone = before_pages - set(self.tree_content().values())
        self.oracle = {k: v for k, v in self.oracle.items() if v not in gone}
        after = self.tree_states()
        for k in set(before_states) - set(after):
            self.ostates.pop(k, None)
        return out

    def oracle_state_match(self, ns, toks):
        kv = self.oracle_match(ns, toks)
        best = 0
        for p in range(self.PAGE, kv + 1, self.PAGE):
            if (ns, tuple(toks[:p])) in self.ostates:
                best = p
        return best

    @rule(ns=st.sampled_from(NAMESPACES), toks=tokens_st, reserve=st.integers(0, 4))
    def acquire(self, ns, toks, reserve):
        rid = f"r{self.n}"
        self.n += 1
        want = self.oracle_state_match(ns, toks[:-1])
        grants, deferred = self.track(lambda: self.pool.admit(
            [Candidate(rid=rid, namespace=ns, token_ids=toks, reserve=reserve)], budget=10**6, max_admit=8))
        if grants:
            g = grants[0]
            assert g.cached_tokens == want       # resume exactly at the deepest checkpoint, never past it
            assert (g.restore_slot >= 0) == (want > 0)
            if want:
                assert self.ostates[(ns, tuple(toks[:want]))] == g.restore_slot
            assert all(p % self.PAGE == 0 and want < p <= len(toks) for p in g.checkpoints)

    def _attached(self, h, upto, ns, toks):
        for pos, slot in sorted(h.items()):
            if pos <= upto:
                self.ostates.setdefault((ns, tuple(toks[:pos])), slot)

    @precondition(lambda self: self.pool.held)
    @rule(data=st.data())
    def progress(self, data):
        rid = data.draw(st.sampled_from(sorted(self.pool.held)))
        h = self.pool.held[rid]
        computed = data.draw(st.integers(0, len(h.tokens)))
        ns, toks, pages, planned = h.namespace, list(h.tokens), list(h.pages), dict(h.planned)
        self.track(lambda: self.pool.progress(Progress(rid=rid, computed=computed)))
        k = computed // self.PAGE * self.PAGE
        self.oracle_insert(ns, toks[:k], pages[:k // self.PAGE])
        self._attached(planned, max(k, h.inserted), ns, toks)

    @precondition(lambda self: self.pool.held)
    @rule(data=st.data(), out=st.lists(st.integers(0, 2), max_size=5))
    def release(self, data, out):
        rid = data.draw(st.sampled_from(sorted(self.pool.held)))
        h = self.pool.held[rid]
        full = h.tokens + out
        computed = data.draw(st.integers(0, min(len(full), len(h.pages) * self.PAGE)))
        tail = data.draw(st.sampled_from([0] + list(range(self.PAGE, computed + 1, self.PAGE))))
        ns, pages, planned, tail_slot, inserted = h.namespace, list(h.pages), dict(h.planned), h.tail, h.inserted
        self.track(lambda: self.pool.release(Release(rid=rid, output_ids=out, computed=computed, tail=tail)))
        k = computed // self.PAGE * self.PAGE
        self.oracle_insert(ns, full[:k], pages[:k // self.PAGE])
        upto = max(k, inserted)
        self._attached(planned, upto, ns, full)
        if 0 < tail <= upto:
            self.ostates.setdefault((ns, tuple(full[:tail])), tail_slot)

    def locked_states(self) -> set[int]:
        out = set()
        for h in self.pool.held.values():
            n = h.node
            while n is not None:
                if n.state is not None:
                    out.add(n.state)
                n = n.parent
        return out

    @rule(n=st.integers(1, 4))
    def evict_states(self, n):
        locked, kv = self.locked_states(), self.tree_content()
        self.track(lambda: self.pool._free_states.extend(self.pool.tree.evict_states(n)))
        assert locked <= set(self.tree_states().values())   # a locked path keeps its checkpoints
        assert self.tree_content() == kv                      # dropping states keeps every page

    @invariant()
    def states_equal_oracle(self):
        assert self.tree_states() == self.ostates

    @invariant()
    def stateful_index_is_the_nodes_with_a_state(self):
        assert set(self.pool.tree._stateful) == {n for n in self.pool.tree.nodes() if n.state is not None}

    @invariant()
    def state_slots_are_conserved(self):
        pool = self.pool
        free = pool._free_states
        cached = list(self.tree_states().values())
        held = [s for h in pool.held.values() for s in [h.working, h.tail, *h.planned.values()]]
        everything = free + cached + held
        assert sorted(everything) == list(range(self.SLOTS))


class PoolPage1(PoolMachine):
    PAGE = 1
    PAGES = 24


class PoolPage4(PoolMachine):
    PAGE = 4
    PAGES = 16


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolPage1 = PoolPage1.TestCase
TestPoolPage1.settings = SETTINGS
TestPoolPage4 = PoolPage4.TestCase
TestPoolPage4.settings = SETTINGS
TestHybridPool = HybridMachine.TestCase
TestHybridPool.settings = SETTINGS


def test_common_pages_finds_where_a_long_key_and_a_prompt_part():
    """_common_pages against a page-by-page count, for keys of up to 200 pages and prompts that part
    from them at every kind of place (first page, middle, last page, not at all, a shorter prompt)."""
    import random
    from radixflow.services.radix.tree import RadixTree
    rng = random.Random(5)
    tree = RadixTree(4)
    for _ in range(300):
        key = tuple(rng.randint(0, 9) for _ in range(4 * rng.randint(1, 200)))
        at = rng.choice([0, rng.randint(0, len(key)), len(key) - 1, len(key)])
        tokens = list(key[:at]) + ([key[at] + 1] if at < len(key) else []) + [rng.randint(0, 9) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.2:
            tokens = tokens[:rng.randint(0, len(tokens))]
        off = rng.randint(0, 3)
        tokens = [7] * off + tokens
        want = 0
        while (want + 1) * 4 <= min(len(key), len(tokens) - off) and key[want * 4:(want + 1) * 4] == tuple(tokens[off + want * 4:off + (want + 1) * 4]):
            want += 1
        assert tree._common_pages(key, tokens, off) == want
