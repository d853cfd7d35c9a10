"""Programs' hold on a PagePool's tree: pins and demotion (see pool.py's docstring).

A request released with `pin` keeps its inserted prefix locked under that key until RadixStep.unpins
names it or the pin's deadline passes (a program whose scheduler vanished); an unpin that comes
before its release is remembered, so that the late release does not pin. A lost select choice is
demoted: its private pages become the first to evict.

A mixin of PagePool (pool.py), which owns the tree, `pins` and `_unpinned`.
"""
from __future__ import annotations

import time
from collections import deque

from radixflow.shared.messages import Demote

from .tree import Node, RadixTree


class Pins:
    """Its contract with the host (PagePool): the attributes annotated here."""
    cache: bool
    tree: RadixTree
    pins: dict[str, tuple[Node, float]]      # key -> (locked node, monotonic deadline)
    _unpinned: deque[str]

    def _pin(self, key: str, node: Node, ttl_s: float) -> None:
        if key in self._unpinned or key in self.pins or node.is_root:
            return
        self.tree.lock(node)
        self.pins[key] = (node, time.monotonic() + (ttl_s if ttl_s > 0 else 900.0))

    def unpin(self, keys: list[str]) -> None:
        for k in keys:
            pin = self.pins.pop(k, None)
            if pin is None:
                self._unpinned.append(k)     # its release may still be on its way: do not pin it then
            else:
                self.tree.unlock(pin[0])

    def expire_pins(self, now: float) -> list[str]:
        """Unpin what outlived its deadline (a program whose scheduler vanished)."""
        gone = [k for k, (_, deadline) in self.pins.items() if now > deadline]
        self.unpin(gone)
        return gone

    def demote(self, d: Demote) -> int:
        if not self.cache:
            return 0
        m = self.tree.match(d.namespace, d.token_ids, split=False)
        return self.tree.demote(m.node, d.keep)

    def pinned_pages(self) -> int:
        seen: set[int] = set()
        for node, _ in self.pins.values():
            while node is not None and not node.is_root and id(node) not in seen:
                seen.add(id(node))
                node = node.parent
        return sum(len(n.pages) for n in self.tree.nodes() if id(n) in seen)
