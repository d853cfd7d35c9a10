"""Siblings: the n completions of one request (OpenAI's and SGLang's `n`) on one stream.

The prompt is prefilled once: a prefill-only parent request computes it, and the n children are
sent with `after` set to it, so the executor holds them back until the parent's release has cached
the prompt; each then computes only the last partial page of the prompt. (The same mechanism
programs use for children of a prefill-only node.)

The stream stays one stream: every chunk carries its child's `index`, sequence numbers are the
stream's, each index's last chunk has its finish_reason, and only the very last chunk of all has
finished=True. The first error of any child is the stream's one terminal StreamError; the other
children are then aborted.
"""
from __future__ import annotations

from typing import Protocol

from radixflow.shared.messages import StreamChunk, StreamError


class Scheduler(Protocol):
    """What a group needs of its scheduler (SchedulerService, service.py)."""
    siblings: dict[str, Siblings]

    async def abort_rids(self, rids: list[str]) -> None: ...

    async def publish_stream(self, subject: str, rid: str, item: StreamChunk | StreamError, as_json: bool,
                             batch: str = "") -> bool: ...


def child_rid(rid: str, index: int) -> str:
    return f"{rid}/{index}"


class Siblings:
    def __init__(self, sched: Scheduler, rid: str, subject: str, n: int, as_json: bool = False,
                 needs_parent: bool = False, batch: str = ""):
        self.sched, self.rid, self.subject, self.n, self.json = sched, rid, subject, n, as_json
        self.batch = batch                       # the reader's StreamBatch subject ("": item by item)
        self.needs_parent = needs_parent         # the parent returns the prompt logprobs: its failure is ours
        self.remaining = n
        self.seq = 0
        self.ended = False
        self.parent_cached = 0                   # what the shared prefill found in the cache
        self.input_logprobs: StreamChunk | None = None   # the parent's last chunk (prompt logprobs)

    @property
    def children(self) -> list[str]:
        return [child_rid(self.rid, i) for i in range(self.n)]

    async def on_parent(self, item: StreamChunk | StreamError) -> None:
        # A failed parent is not the stream's error (each child then computes the prompt itself, and
        # fails on its own if the cause is theirs too), unless it owed the stream the prompt logprobs.
        if isinstance(item, StreamError):
            if self.needs_parent:
                await self._fail(item)
            return
        if item.finished:
            self.parent_cached = item.usage.cached_tokens if item.usage else 0
            self.input_logprobs = item

    async def on_child(self, index: int, item: StreamChunk | StreamError) -> None:
        if self.ended:
            return
        if isinstance(item, StreamError):
            await self._fail(item, but=child_rid(self.rid, index))
            return
        item.seq, self.seq = self.seq, self.seq + 1
        item.rid, item.index = self.rid, index
        if item.finished:
            self.remaining -= 1
            item.finished = self.remaining == 0
            if item.usage is not None:
                item.usage.cached_tokens = self.parent_cached
            if item.finished:
                self.ended = True
                self.sched.siblings.pop(self.rid, None)
                if self.input_logprobs is not None:
                    item.input_logprobs = self.input_logprobs.input_logprobs
                    item.input_top_logprobs = self.input_logprobs.input_top_logprobs
                    item.input_ids = self.input_logprobs.input_ids
        if not await self._publish(item) and item.finish_reason is not None and not self.ended:
            # an unsendable end of a choice went out as the stream's terminal error in its place
            self.ended = True
            self.sched.siblings.pop(self.rid, None)
            await self.sched.abort_rids([self.rid] + self.children)

    async def _fail(self, item: StreamError, but: str = "") -> None:
        """The stream's one terminal error; everything else of the request stops (the parent too)."""
        self.ended = True
        item.rid, item.seq, self.seq = self.rid, self.seq, self.seq + 1
        self.sched.siblings.pop(self.rid, None)
        await self._publish(item)
        await self.sched.abort_rids([r for r in [self.rid] + self.children if r != but])

    async def _publish(self, item: StreamChunk | StreamError) -> bool:
        return await self.sched.publish_stream(self.subject, self.rid, item, self.json, self.batch)
