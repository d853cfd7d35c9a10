"""Keys seen in the last few seconds. A request whose end was sent moments ago still counts as
known when a peer asks (LiveQuery): that end may still be on its way, and calling the request lost
then would give it a second terminal event."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class Recent:
    """`on_expire(key)` is called for each key as it is forgotten (what it stood for can go too)."""

    def __init__(self, keep_s: float, on_expire: Callable[[str], object] | None = None):
        self.keep_s = keep_s
        self.on_expire = on_expire
        self._at: OrderedDict[str, float] = OrderedDict()    # oldest first

    def add(self, key: str) -> None:
        now = time.monotonic()
        self._at[key] = now
        self._at.move_to_end(key)
        self._prune(now)

    def discard(self, key: str) -> None:
        self._at.pop(key, None)

    def prune(self) -> None:
        self._prune(time.monotonic())

    def __contains__(self, key: str) -> bool:
        self._prune(time.monotonic())
        return key in self._at

    def __len__(self) -> int:
        self._prune(time.monotonic())
        return len(self._at)

    def _prune(self, now: float) -> None:
        while self._at and now - next(iter(self._at.values())) > self.keep_s:
            key, _ = self._at.popitem(last=False)
            if self.on_expire is not None:
                self.on_expire(key)
