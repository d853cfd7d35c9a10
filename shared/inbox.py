"""InboxStream: the receiving end of a streamed reply on the bus (shared/bus.py opens it, and is
known here only as the Connection it must be)."""
from __future__ import annotations

import asyncio
import collections
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import nats.errors
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription

from . import messages
from .errors import RadixflowError, RequestTimeout, StreamGap
from .messages import Msg, ProgramEvent, StreamChunk, StreamError


class Connection(Protocol):
    """What a stream needs of its bus (bus.Bus)."""
    inbox_prefix: str
    readers: dict[str, InboxStream]      # the open batched streams by subject: StreamBatch items go there

    async def subscribe(self, subject: str, cb: Callable[[NatsMsg], Awaitable[None]],
                        queue: str = "") -> Subscription: ...

    async def batch_subject(self) -> str: ...


class InboxStream:
    """The receiving end of a streamed reply (StreamChunk* or ProgramEvent*, then a terminal item).

        async with bus.open_stream() as stream:
            await bus.request(SUBMIT, GenerateRequest(stream_subject=stream.subject, ...), Accepted)
            async for item in stream: ...

    Subscribe before submitting, so nothing can arrive before anyone listens. Iteration ends after
    the terminal item; silence past the idle timeout raises RequestTimeout. A skipped sequence
    number (an item lost on the way) is asked of the sender again through `refill` (seq -> the
    items from there, or None), once the producer is known; only when it cannot say does the
    stream end with StreamGap.
    """

    def __init__(self, bus: Connection, idle_timeout_s: float | None, batched: bool = False):
        self.bus = bus
        self.subject = f"{bus.inbox_prefix}.rf.{secrets.token_hex(12)}"   # its reader's own inbox
        self.batched = batched
        self.batch_subject = ""          # set on entering, when batched
        self.idle_timeout_s = idle_timeout_s
        # a deque and one waiter, not an asyncio.Queue under asyncio.timeout: every item of every
        # stream passes here, and a getter future plus a timer per item weigh on the gateway's
        # loop; the idle timer is armed once and re-armed only when it fires early (_idle)
        self._items: collections.deque[bytes | Msg | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sub: Subscription | None = None
        self._next_seq = 0
        self._ahead: dict[int, Any] = {}     # items that arrived past a gap, by seq
        self.refill: Callable[[int], Awaitable[list | None]] | None = None
        self._done = False
        self.heard_at = time.monotonic()     # the latest item (or the opening)
        self.probed_at = 0.0

    async def __aenter__(self) -> "InboxStream":
        async def on_msg(m: NatsMsg) -> None:
            self.put(m.data)
        self._sub = await self.bus.subscribe(self.subject, on_msg)
        if self.batched:
            self.batch_subject = await self.bus.batch_subject()
            self.bus.readers[self.subject] = self
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.bus.readers.pop(self.subject, None)
        if self._timer is not None:
            self._timer.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass

    def put(self, item: bytes | Msg | BaseException, heard: bool = True) -> None:
        """An item (or an error) for the reader."""
        if heard:
            self.heard_at = time.monotonic()
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Wake the reader with an error (a watchdog saw the producer die)."""
        self.put(exc, heard=False)

    def _idle(self) -> None:
        """The idle timer: silent for idle_timeout_s since the latest item, the reader gets
        RequestTimeout; else the timer is set again for that item's deadline."""
        self._timer = None
        left = self.heard_at + self.idle_timeout_s - time.monotonic()
        if left > 0:
            self._timer = asyncio.get_running_loop().call_later(left, self._idle)
        elif not self._done:
            self.put(RequestTimeout(f"stream {self.subject} silent for {self.idle_timeout_s:g}s"), heard=False)

    async def _get(self) -> bytes | Msg | BaseException:
        while not self._items:
            loop = asyncio.get_running_loop()
            if self._timer is None and self.idle_timeout_s is not None:
                self._timer = loop.call_later(max(self.heard_at + self.idle_timeout_s - time.monotonic(), 0), self._idle)
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def __aiter__(self) -> "InboxStream":
        return self

    async def recover(self) -> bool:
        """Ask the producer for the items from the next expected one on (the stream went silent and
        its producer no longer runs it: its end may have been lost). True when it had them: they
        are queued for the reader."""
        items = await self._ask()
        if not items or items[0].seq != self._next_seq:
            return False
        for it in items:
            self.put(it, heard=False)
        return True

    async def _ask(self) -> list | None:
        if self.refill is None:
            return None
        try:
            return await self.refill(self._next_seq)
        except RadixflowError:
            return None

    async def __anext__(self) -> StreamChunk | StreamError | ProgramEvent:
        if self._done:
            raise StopAsyncIteration
        while (out := self._ahead.pop(self._next_seq, None)) is None:
            item = self._items.popleft() if self._items else await self._get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            out = item if isinstance(item, Msg) else messages.decode(item, StreamChunk | StreamError | ProgramEvent)
            if out.seq < self._next_seq:
                continue              # a repeat: a refill and the live item crossed
            self._ahead.setdefault(out.seq, out)
            if out.seq > self._next_seq:
                # an item was lost on the way: the producer sends the missing ones again
                for it in await self._ask() or []:
                    if it.seq >= self._next_seq:
                        self._ahead.setdefault(it.seq, it)
                if self._next_seq not in self._ahead:
                    self._done = True
                    raise StreamGap(f"stream {self.subject}: expected item {self._next_seq}, got {out.seq}")
        self._next_seq += 1
        if isinstance(out, StreamError) or out.finished:
            self._done = True
        return out
