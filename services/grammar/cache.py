"""GrammarCache: compiled grammars by key, least recently used evicted first, bounded in bytes.

The size of an entry is the length of its stored blob (the engine's zlib-compressed serialized
grammar), which is what occupies memory here and what a GrammarFetch sends. Not thread-safe: the service uses it
from the event loop only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheEntry:
    data: bytes          # zlib-compressed Compiled.raw of its engine (backends/)
    raw_size: int        # bytes of the uncompressed serialization
    compile_s: float     # what the compile cost, reported on hits too for insight
    backend: str = "xgrammar"     # the engine that compiled it, hence loads it in the executor
    enforcement: str = "full"     # checked: the finished output must be validated


class GrammarCache:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.capacity = capacity_bytes
        self._items: OrderedDict[str, CacheEntry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: str) -> CacheEntry | None:
        entry = self._items.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return entry

    def peek(self, key: str) -> CacheEntry | None:
        """Look up without counting a hit or miss (a fetch is not a compile request), but refresh
        recency: an executor fetching a grammar means it is in use."""
        entry = self._items.get(key)
        if entry is not None:
            self._items.move_to_end(key)
        return entry

    def put(self, key: str, entry: CacheEntry) -> bool:
        """Store `entry`; False when it alone exceeds the capacity (it is then not stored)."""
        size = len(entry.data)
        if size > self.capacity:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old.data)
        self._items[key] = entry
        self.bytes += size
        while self.bytes > self.capacity:
            _, evicted = self._items.popitem(last=False)
            self.bytes -= len(evicted.data)
            self.evictions += 1
        return True

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "bytes": self.bytes, "entries": len(self._items),
                "evictions": self.evictions, "capacity_bytes": self.capacity}
