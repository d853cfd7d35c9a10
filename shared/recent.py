"""Keys seen in the last few seconds. A request whose end was sent moments ago still counts as
known when a peer asks (LiveQuery): that end may still be on its way, and calling the request lost
then would give it a second terminal event."""
from __future__ import annotations

import time
from collections import OrderedDict


class Recent:
    def __init__(self, keep_s: float):
        self.keep_s = keep_s
        self._at: OrderedDict[str, float] = OrderedDict()    # oldest first

    def add(self, key: str) -> None:
        now = time.monotonic()
        self._at[key] = now
        self._at.move_to_end(key)
        self._prune(now)

    def __contains__(self, key: str) -> bool:
        self._prune(time.monotonic())
        return key in self._at

    def __len__(self) -> int:
        self._prune(time.monotonic())
        return len(self._at)

    def _prune(self, now: float) -> None:
        while self._at and now - next(iter(self._at.values())) > self.keep_s:
            self._at.popitem(last=False)
