"""A free list of integer ids: the executor's DeltaNet state slots (KV pages belong to the radix
service, see pages.py)."""
from __future__ import annotations


class FreeList:
    """Integer ids 0..n-1, all-or-nothing allocation."""

    def __init__(self, n: int):
        self.total = n
        self._free = list(range(n - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, k: int) -> list[int] | None:
        if k > len(self._free):
            return None
        out = [self._free.pop() for _ in range(k)]
        return out

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)
        assert len(self._free) <= self.total, "double free"


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)
