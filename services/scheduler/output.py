"""The scheduler's output half: what executors computed, to the client's stream.

    StepOutput (one per executor step) -> gap check -> one batched detokenize -> stop strings and
    the output check (resample what fails it) -> stream items; and every request's one terminal
    event: _end (its finished chunk) or fail (a StreamError).

A mixin of SchedulerService (service.py), which owns the state used here: the request table, the
detokenizer, the stream log, the recovery and the latency histograms. OutputPath declares what it
uses of its host (annotations only: nothing here shadows the host's own).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
from structlog.stdlib import BoundLogger

from radixflow.shared import ids as ids_, log, subjects
from radixflow.shared.bus import Bus
from radixflow.shared.config import SchedulerConfig
from radixflow.shared.errors import PayloadTooLarge, RadixflowError
from radixflow.shared.histogram import Histogram
from radixflow.shared.messages import (AbortRequest, DetokItem, ExecAccepted, Resend, Resent, SeqOutput, StepOutput,
                                       StreamBatch, StreamChunk, StreamError, Usage)
from radixflow.shared.recent import Recent

from .detok import Detokenizer
from .executors import ExecutorState
from .recovery import Recovery
from .stops import StopMatcher
from .streamlog import StreamLog
from .structured import Checks
from .table import RequestTable, Tracked


# steps taken in before their text is made (while more are waiting): bounds how long a loop that
# fell behind holds items back
MAX_ABSORBED = 16


class OutputPath:
    # the host's (SchedulerService)
    bus: Bus
    cfg: SchedulerConfig
    log: BoundLogger
    table: RequestTable
    executors: dict[str, ExecutorState]
    detok: Detokenizer
    checks: Checks
    recovery: Recovery
    streams: StreamLog
    ended: Recent
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    output_subject: str
    resampled_total: int
    queued: Callable[[str], int]                                  # Actor's: messages waiting on a subject
    _abort_quietly: Callable[[str, list[str]], Awaitable[None]]
    # this path's own, set up by the host: outputs taken in and not yet sent, steps taken in since
    # the last pass, the items of the pass under way (by reader), and requests whose end waits for
    # their check
    _unsent: dict[str, tuple[Tracked, SeqOutput]]
    _absorbed: int
    _outbox: dict[str, list] | None
    _checking: set[asyncio.Task]

    async def on_output(self, step: StepOutput) -> None:
        """Take one executor step in (its tokens onto each request), then, unless more steps are
        already waiting, make the text and the stream items of everything taken in since the last
        time: a loop that falls behind sends fewer, larger items instead of a backlog of small ones.
        Every item of one pass to the same reader goes in one message (StreamBatch)."""
        await self._absorb(step)
        if self.queued(self.output_subject) and self._absorbed < MAX_ABSORBED:
            self._absorbed += 1
            return
        self._absorbed = 0
        pending, self._unsent = self._unsent, {}
        live = [(t, o) for t, o in pending.values() if self.table.get(t.rid) is t and not t.stopping]
        if not live:
            return
        self._outbox = {}
        try:
            await self._emit(live)
        finally:
            outbox, self._outbox = self._outbox, None
            await self._flush(outbox)

    async def _absorb(self, step: StepOutput) -> None:
        # only the executor that runs a request now speaks for it: one it moved away from (recovery.py)
        # or one that never had it is not heard
        live = [(t, o) for o in step.outputs if (t := self.table.get(o.rid)) is not None and not t.stopping
                and t.executor == step.executor]
        if not live:
            return
        now = time.monotonic()
        gaps = [(t, o) for t, o in live if o.offset != len(t.output_ids)]
        for t, o in gaps:
            # an earlier output of it was lost (NATS delivers at most once): ask its executor for
            # the missing tokens; only if it cannot say does the request fail
            if not await self.recovery.fill_gap(t, o, step.executor):
                await self.fail(t, 502, "stream_gap", f"output lost in transit: expected token {len(t.output_ids)}, "
                                 f"got {o.offset} from executor {step.executor}", abort=not o.finished)
        if gaps:
            live = [(t, o) for t, o in live if o.offset == len(t.output_ids)]
        for t, o in live:
            t.heard_at = now
            if o.token_ids:
                if t.last_token_at:
                    self.itl.observe((now - t.last_token_at) / len(o.token_ids))
                else:
                    self.ttft.observe(now - t.accepted_at)
                t.last_token_at = now
            t.output_ids.extend(o.token_ids)
            t.cached_tokens = o.cached_tokens
            t.logprobs.extend(o.logprobs)
            t.top_logprobs.extend(o.top_logprobs)
            if o.input_logprobs:
                t.input_logprobs, t.input_top_logprobs = o.input_logprobs, o.input_top_logprobs
            # a non-streaming request without stop strings is detokenized once, when it ends; the
            # latest output of each request says whether it ended (the earlier ones did not)
            if t.incremental or o.finished:
                self._unsent[t.rid] = (t, o)

    async def _emit(self, live: list[tuple[Tracked, SeqOutput]]) -> None:
        try:
            done = await self.detok.run([
                DetokItem(ids=t.output_ids[t.prefix_offset:], prefix_offset=t.prefix_offset, read_offset=t.read_offset,
                          skip_special_tokens=t.sampling.skip_special_tokens, flush=o.finished) for t, o in live])
        except RadixflowError as e:
            for t, _ in live:
                await self.fail(t, e.code, e.kind, f"detokenization failed: {e.message}", abort=True)
            return
        stopped: dict[str, list[str]] = {}
        for (t, o), d in zip(live, done):
            t.prefix_offset, t.read_offset = d.prefix_offset, d.read_offset
            text, hit = t.stops.feed(d.text, final=o.finished)
            if t.check is not None:
                t.text += text
                if (o.finished or hit is not None) and not o.error:
                    # its end waits for the check, which runs a caller's patterns: off the loop, and
                    # not in this ordered handler, where it would hold every other request's outputs
                    t.stopping = True
                    task = asyncio.ensure_future(self._checked_end(t, o, text, hit))
                    self._checking.add(task)
                    task.add_done_callback(self._checking.discard)
                    continue
            if o.error:
                await self.fail(t, o.error_code, "service_unavailable" if o.error_code == 503 else "internal_error",
                                 o.error)
            elif hit is not None:
                t.stopping = True
                await self._end(t, text, "stop", hit)
                if not o.finished:
                    stopped.setdefault(t.executor, []).append(t.rid)
            elif o.finished:
                await self._end(t, text, o.finish_reason or "stop", o.matched_stop)
            elif t.hold:
                t.held += text
            else:
                await self.send(t, t.take(text))
        for ex, rids in stopped.items():
            await self.bus.publish(subjects.executor_abort(ex), AbortRequest(rids=rids))

    async def _checked_end(self, t: Tracked, o: SeqOutput, text: str, hit) -> None:
        """A checked request's end: the output check (a thread), then its end, a resample or its error."""
        try:
            bad = await self.checks.error(t.check, t.text, "stop" if hit is not None else o.finish_reason)
        except RadixflowError as e:      # the check ran out of time: the schema, not the output
            await self.fail(t, e.code, e.kind, e.message, abort=not o.finished)
            return
        if bad is not None:
            if o.finished and o.finish_reason != "length" and await self._resample(t, bad):
                return
            await self.fail(t, 400 if o.finish_reason == "length" else 500,
                            "invalid_request_error" if o.finish_reason == "length" else "invalid_output",
                            bad + (f" (after {t.resamples + 1} attempts)" if t.resamples else ""),
                            abort=not o.finished)
        elif hit is not None:
            await self._end(t, text, "stop", hit)
            if not o.finished:
                await self._abort_quietly(t.executor, [t.rid])
        else:
            await self._end(t, text, o.finish_reason or "stop", o.matched_stop)

    async def send(self, t: Tracked, item: StreamChunk | StreamError) -> None:
        """One of a request's items to its reader: its sink (a group's, a handoff's, a program's),
        else its stream."""
        if t.sink is not None:
            await t.sink(item)
            return
        await self.publish_stream(t.stream_subject, t.rid, item, t.json, t.batch)

    async def publish_stream(self, subject: str, rid: str, item: StreamChunk | StreamError, as_json: bool,
                             batch: str = "") -> bool:
        """Send one stream item; False when it could not be sent. An unsendable end of a choice
        (an oversize last chunk) becomes the stream's terminal StreamError in its place. Within an
        output pass, an item whose reader takes batches waits in the outbox for the pass's end."""
        terminal = isinstance(item, StreamError) or item.finished
        if terminal:
            self.ended.add(rid)
        item.rid = ids_.unscoped(item.rid)         # the caller's own id (ours is scoped by its tenant)
        self.streams.record(subject, item, terminal)
        if batch and not as_json and self._outbox is not None:
            self._outbox.setdefault(batch, []).append((subject, rid, item))
            return True
        return await self._publish_item(subject, rid, item, as_json)

    async def _flush(self, outbox: dict[str, list] | None) -> None:
        """One StreamBatch per reader; one too large for a message goes in halves, and a batch that
        cannot be sent at all goes item by item (each then fails on its own)."""
        for batch, entries in (outbox or {}).items():
            await self._send_batch(batch, entries)

    async def _send_batch(self, batch: str, entries: list) -> None:
        try:
            await self.bus.publish(batch, StreamBatch(subjects=[e[0] for e in entries], items=[e[2] for e in entries]))
        except PayloadTooLarge:
            if len(entries) == 1:
                await self._publish_item(*entries[0], False)
                return
            half = len(entries) // 2
            await self._send_batch(batch, entries[:half])
            await self._send_batch(batch, entries[half:])
        except RadixflowError:
            for subject, rid, item in entries:
                await self._publish_item(subject, rid, item, False)

    async def _publish_item(self, subject: str, rid: str, item: StreamChunk | StreamError, as_json: bool) -> bool:
        try:
            await self.bus.publish(subject, item, as_json)
            return True
        except RadixflowError as e:
            self.log.error("stream item not sent", rid=rid, error=e.message)
            if isinstance(item, StreamChunk) and (item.finished or item.finish_reason is not None):
                err = StreamError(rid=rid, seq=item.seq, code=e.code, kind=e.kind,
                                  message=f"the result could not be sent: {e.message}")
                self.streams.record(subject, err, True)
                try:
                    await self.bus.publish(subject, err, as_json)
                except RadixflowError:
                    pass
            return False

    async def resend(self, q: Resend) -> Resent:
        """Items of a stream this scheduler sent, again: a gateway lost some on the way."""
        items = self.streams.since(q.subject, q.seq)
        return Resent(found=items is not None, items=items or [])

    async def _end(self, t: Tracked, text: str, reason: str, matched) -> None:
        if self.table.finish(t.rid) is None:
            return
        self.e2e.observe(time.monotonic() - t.accepted_at)
        self._release(t)
        text, t.held = t.held + text, ""
        await self.send(t, t.take(text, finished=True, finish_reason=reason, matched_stop=matched, usage=Usage(
            prompt_tokens=t.prompt_tokens, completion_tokens=len(t.output_ids), cached_tokens=t.cached_tokens,
            resamples=t.resamples),
            input_logprobs=t.input_logprobs, input_top_logprobs=t.input_top_logprobs, input_ids=t.prompt_ids))

    async def _resample(self, t: Tracked, why: str) -> bool:
        """A finished output failed the check of what its grammar does not enforce: sample it again
        with another seed (greedy requests are sampled at temperature 1: greedy would repeat
        itself), if nothing of it has reached the client and attempts remain. False: fail it."""
        if t.resamples >= self.cfg.max_resamples or t.next_seq or t.exec_req is None:
            return False
        t.resamples += 1
        self.resampled_total += 1
        with log.bind_request(t.rid):
            self.log.info("output failed its check; resampling", attempt=t.resamples + 1, why=why[:200])
        s = t.exec_req.sampling
        seed = (s.seed if s.seed is not None else 0x5EED) + 7919 * t.resamples
        sampling = msgspec.structs.replace(s, seed=seed, temperature=s.temperature if s.temperature > 0 else 1.0)
        req = msgspec.structs.replace(t.exec_req, sampling=sampling, after="", logprob_start=-1)
        t.output_ids, t.logprobs, t.top_logprobs = [], [], []
        t.prefix_offset = t.read_offset = t.sent = 0
        t.heard_at = time.monotonic()
        t.text, t.held = "", ""
        t.stops = StopMatcher(t.sampling.stop)
        t.stopping = False
        try:
            await self.bus.request(subjects.executor_submit(t.executor), req, ExecAccepted, timeout=40)
        except RadixflowError as e:
            await self.fail(t, e.code, e.kind, f"resampling failed: {e.message}")
        return True

    async def fail(self, t: Tracked, code: int, kind: str, message: str, abort: bool = False) -> None:
        if self.table.finish(t.rid) is None:
            return
        self._release(t)
        with log.bind_request(t.rid):
            self.log.warning("request failed", code=code, error=message)
        await self.send(t, StreamError(rid=t.rid, seq=t.take_seq(), code=code, kind=kind, message=message))
        if abort:
            try:
                await self.bus.publish(subjects.executor_abort(t.executor), AbortRequest(rids=[t.rid]))
            except RadixflowError:
                pass

    def _release(self, t: Tracked) -> None:
        if t.sink is None:
            self.streams.close(t.stream_subject)
        ex = self.executors.get(t.executor)
        if ex is not None:
            ex.inflight = max(0, ex.inflight - 1)
