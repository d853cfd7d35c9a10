"""Held: what the PagePool knows of one running request (its pages, its lock on the tree, its
state slots). See pool.py's docstring."""
from __future__ import annotations

from dataclasses import dataclass, field

from .tree import Node


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(eq=False)
class Held:
    namespace: str
    tokens: list[int]
    pages: list[int]      # the request's whole page table
    node: Node            # locked: the deepest tree node of its KV match / inserted prefix
    inserted: int = 0     # tokens already inserted into the tree
    keep: int = 0         # tokens matched at admission (shared with others: never demoted for this one)
    computing: tuple | None = None   # the uncached page it computes first (see PagePool._next_page)
    working: int = -1                # state slots (hybrid)
    tail: int = -1
    planned: dict[int, int] = field(default_factory=dict)   # checkpoint position -> slot
    quota: int = 0                   # > 0: its owner may keep at most this many cached pages
    node_end: int = 0                # where `node` ends: its match (hybrid: may pass `inserted`), then `inserted`
