"""RadixTree: cached KV pages keyed by token ids, at page granularity, one root per cache namespace.

    root(ns) ── [t0..t15 | t16..t31] ──┬── [t32..t47]            a node's key is a run of whole pages;
              pages [p7, p2]           └── [u32..u47 | ...]      children keyed by their first page

- match walks page by page and splits a node where a match ends inside it, so a match always ends
  on a node boundary (that node is what a request locks);
- lock counts propagate to the root: a node with lock == 0 has no locked descendant, so every page
  of an unlocked node is evictable, eventually (leaves first);
- evict frees least-recently-used unlocked leaves, repeatedly, until enough pages are free;
  restricted to some owners it never touches another owner's leaves (quotas, scoped flush). The
  unrestricted kind, which a full pool runs at every admission, reads a lazy heap (`_lru`) instead
  of walking the whole tree;
- a namespace is "scope" or "scope/salt"; its owner is the scope, and the tree counts the pages
  each owner keeps (`owner_pages`), which is what a tenant's page quota limits;
- for hybrid models a node may also carry a state slot: the recurrent state after its last token.
  A prefix is resumable only up to the deepest node with a state (`Match.state_len`). States have
  an LRU of their own (`evict_states`): dropping a state keeps the node's KV, and a node without a
  state still serves as KV for deeper nodes that have one. A locked node keeps its state too.
No torch, no I/O: page and slot ids are plain ints owned by whoever allocates them (PagePool).
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Collection, Iterator, NamedTuple

_clock = itertools.count()


def owner_of(namespace: str) -> str:
    """The scope a cache namespace belongs to: "alpha" for "alpha" and for "alpha/<salt>"."""
    return namespace.split("/", 1)[0]


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    pages: list[int]
    parent: "Node | None"
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    lock: int = 0
    last_access: int = 0
    namespace: str = ""
    state: int | None = None    # state slot holding the recurrent state after this node's last token

    @property
    def is_root(self) -> bool:
        return self.parent is None


class Match(NamedTuple):
    node: Node          # deepest matched node (the root when nothing matched)
    length: int         # matched tokens, a multiple of page_size
    pages: list[int]    # the pages of those tokens, in order
    state_len: int = 0              # end of the deepest matched node carrying a state (0: none)
    state_node: Node | None = None  # that node


class Evicted(NamedTuple):
    pages: list[int]
    states: list[int]


class RadixTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.roots: dict[str, Node] = {}
        self.cached_pages = 0        # pages held by the tree
        self.evictable_pages = 0     # pages held by unlocked nodes
        self.owner_pages: dict[str, int] = {}   # owner (see owner_of) -> pages its namespaces hold
        # the nodes carrying a state, in the order they got it (a dict: deterministic ties), so that
        # evict_states reads these instead of walking the whole tree at every admission short of slots
        self._stateful: dict[Node, None] = {}
        # (last_access, id, node) with an entry for every unlocked leaf, maybe older than its last
        # access (a match touched it since) or for a node no longer an unlocked leaf: evict takes an
        # entry only when it is current, and re-files a stale one. A full pool evicts at every
        # admission, and a walk of all nodes for that grows with the cache
        self._lru: list[tuple[int, int, Node]] = []

    def root(self, namespace: str) -> Node:
        r = self.roots.get(namespace)
        if r is None:
            r = self.roots[namespace] = Node((), [], None, lock=1, namespace=namespace)   # roots never evict
        return r

    def _first(self, tokens, i: int) -> tuple[int, ...]:
        return tuple(tokens[i:i + self.page_size])

    # ------------------------------------------------------------ match / insert

    def match(self, namespace: str, tokens: list[int], split: bool = True,
              start: tuple[Node, int] | None = None) -> Match:
        """Longest cached page-aligned prefix of `tokens` in `namespace`. With split=False the tree is
        left untouched (and the match may end inside a node; `node` is then the last full node).
        `start` (node, end): the caller knows that `node` ends at `end` on the path of `tokens` (a
        request's own locked node): the walk starts there, the path above is only touched, and
        `pages` and the state fields cover what lies below it."""
        node, i, pages, ps = self.root(namespace), 0, [], self.page_size
        state_len, state_node = 0, None
        now = next(_clock)
        if start is not None:
            node, i = start
            up = node
            while up is not None:
                up.last_access = now
                up = up.parent
        node.last_access = now
        limit = len(tokens) - len(tokens) % ps
        while i < limit:
            child = node.children.get(self._first(tokens, i))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n * ps < len(child.key):
                if not split:
                    pages.extend(child.pages[:n])
                    i += n * ps
                    break
                child = self._split(child, n)
            child.last_access = now
            pages.extend(child.pages)
            i += len(child.key)
            node = child
            if node.state is not None:
                state_len, state_node = i, node
        return Match(node, i, pages, state_len, state_node)

    def insert(self, namespace: str, tokens: list[int], pages: list[int], start: tuple[Node, int] | None = None) -> Node:
        """Cache `tokens` (a whole number of pages) backed by `pages`; returns the node ending at
        len(tokens). Where the tree already holds a prefix it keeps its own pages: the caller's
        copies of that prefix stay the caller's to free. `start`: as in match (a running request's
        progress inserts below its own node, not from the root again)."""
        ps = self.page_size
        assert len(tokens) % ps == 0 and len(pages) == len(tokens) // ps, (len(tokens), len(pages))
        m = self.match(namespace, tokens, start=start)
        n = m.length // ps
        node = m.node
        if m.length < len(tokens):
            leaf = Node(tuple(tokens[m.length:]), list(pages[n:]), node, namespace=namespace,
                        last_access=next(_clock))
            node.children[leaf.key[:ps]] = leaf
            self.cached_pages += len(leaf.pages)
            self.evictable_pages += len(leaf.pages)
            self._count(namespace, len(leaf.pages))
            self._offer(leaf)
            node = leaf
        return node

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], i: int) -> int:
        """Whole pages that `key` shares with tokens[i:]. One C-level comparison in the usual case
        (the node matches entirely); where they diverge, a search that compares each token about
        once more: each probe compares only the pages between the last known equal one and the
        middle (comparing from the start at every probe was most of an agent's admission)."""
        ps = self.page_size
        n = min(len(key), len(tokens) - i) // ps * ps
        seg = tuple(tokens[i:i + n])
        if key[:n] == seg:
            return n // ps
        lo, hi = 0, n // ps          # invariant: the first lo pages are equal, the first hi are not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key[lo * ps:mid * ps] == seg[lo * ps:mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo

    def cut(self, node: Node, end: int, pos: int) -> Node:
        """The node ending at `pos` on the path to `node` (which ends at `end`; 0 < pos <= end),
        splitting the node that spans `pos`: what match(tokens[:pos]) returns, without matching."""
        assert pos % self.page_size == 0 and 0 < pos <= end, (pos, end)
        while end - len(node.key) >= pos:
            end -= len(node.key)
            node = node.parent
        if end == pos:
            return node
        return self._split(node, (len(node.key) - (end - pos)) // self.page_size)

    @staticmethod
    def path_pages(node: Node) -> list[int]:
        """The pages of the path from the root to `node`, in order."""
        parts = []
        while node is not None:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    def _split(self, child: Node, n_pages: int) -> Node:
        """Cut `child` after n_pages; the new upper node inherits its lock count (locks run to the root)."""
        ps = self.page_size
        parent = child.parent
        upper = Node(child.key[:n_pages * ps], child.pages[:n_pages], parent, lock=child.lock,
                     last_access=child.last_access, namespace=child.namespace)
        parent.children[upper.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[n_pages * ps:], child.pages[n_pages:], upper
        upper.children[child.key[:ps]] = child
        return upper

    # ------------------------------------------------------------ locks

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock == 0:
                self.evictable_pages -= len(node.pages)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            assert node.lock > 0, "unlock of an unlocked node"
            node.lock -= 1
            if node.lock == 0:
                self.evictable_pages += len(node.pages)
                self._offer(node)
            node = node.parent

    # ------------------------------------------------------------ eviction

    def _count(self, namespace: str, pages: int) -> None:
        owner = owner_of(namespace)
        left = self.owner_pages.get(owner, 0) + pages
        if left:
            self.owner_pages[owner] = left
        else:
            self.owner_pages.pop(owner, None)

    def _offer(self, node: Node) -> None:
        """File `node` in the LRU heap if it is an unlocked leaf (it may have just become one)."""
        if node.lock == 0 and not node.children and node.parent is not None:
            heapq.heappush(self._lru, (node.last_access, id(node), node))
            if len(self._lru) > 2 * self.cached_pages + 1024:
                # mostly stale entries (a hot prefix locked and unlocked over and over, no eviction):
                # file afresh, at most once per cached_pages + 1024 entries, so O(1) per entry
                self._lru = [(n.last_access, id(n), n) for n in self.nodes() if not n.children and n.lock == 0]
                heapq.heapify(self._lru)

    def _in_tree(self, node: Node) -> bool:
        p = node.parent
        return p is not None and p.children.get(node.key[:self.page_size]) is node

    def evict(self, n_pages: int, owners: Collection[str] | None = None, exact: bool = False) -> Evicted:
        """Free at least n_pages (fewer if not enough are unlocked), LRU leaves first (ties: by
        id()); a leaf's state slot goes with it. With `owners`, only leaves of those
        owners' namespaces (`exact`: of those namespaces), found by a walk."""
        if owners is not None:
            heap = [(n.last_access, id(n), n) for n in self.nodes(owners, exact) if not n.children and n.lock == 0]
            heapq.heapify(heap)
        else:
            heap = self._lru
        freed: list[int] = []
        states: list[int] = []
        while heap and len(freed) < n_pages:
            t, _, leaf = heapq.heappop(heap)
            if heap is self._lru:
                if leaf.lock or leaf.children or not self._in_tree(leaf):
                    continue              # filed again when it is an unlocked leaf again
                if t != leaf.last_access:
                    heapq.heappush(heap, (leaf.last_access, id(leaf), leaf))
                    continue
            freed.extend(leaf.pages)
            if leaf.state is not None:
                states.append(leaf.state)
                leaf.state = None
                del self._stateful[leaf]
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            self.cached_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            self._count(leaf.namespace, -len(leaf.pages))
            if not parent.children and parent.lock == 0 and not parent.is_root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
                if heap is not self._lru:
                    self._offer(parent)
        return Evicted(freed, states)

    def droppable_states(self) -> int:
        """Checkpoints evict_states could drop now (on unlocked nodes)."""
        return sum(1 for x in self._stateful if x.lock == 0)

    def evict_states(self, n: int, owners: Collection[str] | None = None) -> list[int]:
        """Drop the states of up to n unlocked nodes (of `owners`' namespaces, if given), least
        recently used first; their KV stays."""
        cands = sorted((x for x in self._stateful if x.lock == 0 and (owners is None or owner_of(x.namespace) in owners)),
                       key=lambda x: x.last_access)
        out = []
        for x in cands[:n]:
            out.append(x.state)
            x.state = None
            del self._stateful[x]
        return out

    def demote(self, node: Node, keep: int) -> int:
        """Make the path ending at `node` the first to evict, up to (not into) the first `keep`
        tokens, a shared branch point, or a locked node; returns the pages demoted."""
        end, up = 0, node
        while not up.is_root:
            end, up = end + len(up.key), up.parent
        n, pages = node, 0
        while not n.is_root and n.lock == 0 and len(n.children) <= 1 and end - len(n.key) >= keep:
            n.last_access = -1           # older than any clock value: evict() and evict_states() take it first
            self._offer(n)
            pages += len(n.pages)
            end -= len(n.key)
            n = n.parent
        return pages

    def flush(self, owners: Collection[str] | None = None, namespaces: Collection[str] = ()) -> Evicted:
        """Free every unlocked page (and the states of those nodes), or only those of `owners`,
        or only those of `namespaces` (exact names, or prefixes ending in "*")."""
        if namespaces:
            owners = [ns for ns in self.roots if any(ns == p or p.endswith("*") and ns.startswith(p[:-1])
                                                     for p in namespaces)]
            return self.evict(self.evictable_pages, owners, exact=True)
        return self.evict(self.evictable_pages, owners)

    def set_state(self, node: Node, slot: int) -> bool:
        """Attach a checkpoint to `node`; False if it already has one (the caller keeps its slot)."""
        if node.state is not None or node.is_root:
            return False
        node.state = slot
        self._stateful[node] = None
        return True

    # ------------------------------------------------------------ inspection

    def nodes(self, owners: Collection[str] | None = None, exact: bool = False) -> Iterator[Node]:
        """Every node but the roots; with `owners`, only those in these owners' namespaces (`exact`:
        in these namespaces)."""
        roots = [r for ns, r in self.roots.items() if owners is None or (ns if exact else owner_of(ns)) in owners]
        stack = [c for r in roots for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def checkpoints_on(self, namespace: str, tokens: list[int]) -> list[int]:
        """Ends of the nodes carrying a state along the cached path of `tokens` (read-only)."""
        node, i, out = self.root(namespace), 0, []
        while i + self.page_size <= len(tokens):
            child = node.children.get(self._first(tokens, i))
            if child is None or self._common_pages(child.key, tokens, i) * self.page_size < len(child.key):
                break
            i += len(child.key)
            node = child
            if node.state is not None:
                out.append(i)
        return out

    def sequences(self, namespace: str) -> list[tuple[tuple[int, ...], list[int]]]:
        """Every root-to-leaf path as (tokens, pages): the tree's content, for tests and oracles."""
        out = []
        stack = [(c, (), []) for c in self.root(namespace).children.values()]
        while stack:
            n, toks, pages = stack.pop()
            toks, pages = toks + n.key, pages + n.pages
            if not n.children:
                out.append((toks, pages))
            stack.extend((c, toks, pages) for c in n.children.values())
        return out
