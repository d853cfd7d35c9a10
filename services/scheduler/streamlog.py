"""What this scheduler sent on each stream, so that a gateway that lost items on the way (NATS
delivers at most once: a reconnect, a node failover) gets them again (rf.scheduler.<id>.resend)
instead of failing the stream with a gap. A stream's items are kept while it runs and keep_s
after its end: a lost end is found by the gateway's stall probe, stall_check_s after it. Bounded:
at most max_items per stream (the latest; an older gap is past mending) and max_streams streams.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from radixflow.shared.messages import ProgramEvent, StreamChunk, StreamError
from radixflow.shared.recent import Recent

Item = StreamChunk | StreamError | ProgramEvent
KEEP_S = 30.0
MAX_STREAMS = 65_536
MAX_ITEMS = 4096
MAX_RESENT = 64          # items per answer (a chunk can be large); the gateway asks again for more


class StreamLog:
    def __init__(self, keep_s: float = KEEP_S, max_streams: int = MAX_STREAMS, max_items: int = MAX_ITEMS):
        self.keep_s, self.max_streams, self.max_items = keep_s, max_streams, max_items
        self._streams: OrderedDict[str, deque[Item]] = OrderedDict()   # oldest stream first
        self._ended = Recent(keep_s, on_expire=lambda subject: self._streams.pop(subject, None))

    def record(self, subject: str, item: Item, terminal: bool) -> None:
        """`item` was sent (or is about to be) on `subject`; one of the same seq replaces it (the
        error sent in place of a chunk that could not be)."""
        q = self._streams.get(subject)
        if q is None:
            q = self._streams[subject] = deque(maxlen=self.max_items)
            while len(self._streams) > self.max_streams:
                old, _ = self._streams.popitem(last=False)
                self._ended.discard(old)
        if q and q[-1].seq == item.seq:
            q[-1] = item
        else:
            q.append(item)
        if terminal:
            self.close(subject)
        self._ended.prune()

    def close(self, subject: str) -> None:
        """The stream ended (or its request was dropped): keep its items keep_s more."""
        if subject in self._streams and subject not in self._ended:
            self._ended.add(subject)

    def since(self, subject: str, seq: int) -> list[Item] | None:
        """The items of `subject` from `seq` on (at most MAX_RESENT); None when the stream is not
        known here, or its items from `seq` are gone."""
        self._ended.prune()
        q = self._streams.get(subject)
        if q is None or not q or q[0].seq > seq:
            return None
        return [i for i in q if i.seq >= seq][:MAX_RESENT]

    def __len__(self) -> int:
        return len(self._streams)
