"""EngineClient: how the gateway talks to the engine over the bus.

One call = subscribe a stream inbox, submit to the scheduler (accept or reject fast), then read the
stream until its terminal item. It also watches scheduler heartbeats: if the scheduler that owns a
request goes silent, the request fails fast with 503 instead of hanging.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from radixflow.shared import ids as ids_, subjects
from radixflow.shared.bus import Bus
from radixflow.shared.inbox import InboxStream
from radixflow.shared.errors import NotFound, RadixflowError, RequestLost, RequestTimeout, ServiceUnavailable, StreamGap, from_reply
from radixflow.shared.messages import (AbortRequest, Accepted, DetokenizeReply, DetokenizeRequest, DetokItem, LiveQuery,
                                       LiveReply,
                                       ErrorReply, ExecutorInfo, GenerateRequest, Heartbeat, ProgramAccepted,
                                       ProgramEvent, ProgramInfo, ProgramQuery, ProgramRequest, Resend, Resent,
                                       StreamChunk,
                                       StreamError, TopLogprobs)

KEEP_OWNERS = 10_000     # program id -> its scheduler, for GET / DELETE without a broadcast
TEXTS_PER_REQUEST = 2048  # token texts per detokenize request (about 80 bytes each on the bus)


@dataclass
class Choice:
    """One completion, accumulated from the stream items of its index."""
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None


@dataclass
class Result:
    """A finished request: its n choices and the prompt's accounting."""
    rid: str
    prompt_tokens: int = 0
    choices: list[Choice] = field(default_factory=list)
    cached_tokens: int = 0
    input_ids: list[int] = field(default_factory=list)          # from logprob_start, when asked
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    grammar_backend: str = ""          # structured output: which engine, and whether part is only checked
    enforcement: str = ""
    grammar_compile_s: float = 0.0     # the grammar service's own compile time (0 on a cache hit)
    resamples: int = 0                 # outputs discarded for failing the check (all choices)

    def accepted(self, acc: Accepted) -> None:
        self.prompt_tokens, self.grammar_backend, self.enforcement = acc.prompt_tokens, acc.grammar_backend, \
            acc.enforcement
        self.grammar_compile_s = acc.grammar_compile_s

    def headers(self) -> dict[str, str]:
        """What a structured-output response tells about its guarantee, as response headers."""
        if not self.grammar_backend:
            return {}
        return {"x-radixflow-grammar-backend": self.grammar_backend,
                "x-radixflow-grammar-enforcement": self.enforcement, "x-radixflow-resamples": str(self.resamples),
                "x-radixflow-grammar-compile-ms": f"{self.grammar_compile_s * 1000:.1f}"}

    def add(self, item: StreamChunk) -> Choice:
        while len(self.choices) <= item.index:
            self.choices.append(Choice(index=len(self.choices)))
        c = self.choices[item.index]
        c.text += item.text
        c.output_ids.extend(item.token_ids)
        c.logprobs.extend(item.logprobs)
        c.top_logprobs.extend(item.top_logprobs)
        if item.finish_reason is not None:
            c.finish_reason, c.matched_stop = item.finish_reason, item.matched_stop
        if item.usage is not None:
            self.cached_tokens = item.usage.cached_tokens
            self.resamples += item.usage.resamples
        if item.input_logprobs or item.input_ids:
            self.input_ids, self.input_logprobs = item.input_ids, item.input_logprobs
            self.input_top_logprobs = item.input_top_logprobs
        return c

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.output_ids) for c in self.choices)


class EngineClient:
    def __init__(self, bus: Bus, scheduler_timeout_s: float, request_timeout_s: float = 960.0,
                 stall_check_s: float = 5.0, origin: str = "", coalesce: bool = True):
        self.bus = bus
        self.coalesce = coalesce      # its streams take StreamBatch messages (one per scheduler pass)
        self.origin = origin          # this gateway's instance: schedulers drop its requests once it stops beating
        self.stall_check_s = stall_check_s
        self.scheduler_timeout_s = scheduler_timeout_s
        self.request_timeout_s = request_timeout_s
        self._schedulers: dict[str, float] = {}           # instance -> last heartbeat (monotonic)
        self._executors: dict[str, tuple[float, ExecutorInfo]] = {}
        self._streams: dict[str, tuple[str, InboxStream]] = {}   # rid -> (scheduler, stream)
        self._owners: dict[str, str] = {}                       # program id -> scheduler instance
        self.resent_total = 0                                   # stream items lost on the way and sent again

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        now = time.monotonic()
        if hb.service == "scheduler":
            self._schedulers[hb.instance] = now
        elif hb.service == "executor":
            try:
                self._executors[hb.instance] = (now, msgspec.convert(hb.detail, ExecutorInfo))
            except msgspec.ValidationError:
                pass

    def executors(self) -> list[str]:
        """The executor instances beating within the timeout."""
        now = time.monotonic()
        return [i for i, (t, _) in self._executors.items() if now - t <= self.scheduler_timeout_s]

    def schedulers(self) -> list[str]:
        """The scheduler instances beating within the timeout."""
        now = time.monotonic()
        return [i for i, t in self._schedulers.items() if now - t <= self.scheduler_timeout_s]

    def sampling_defaults(self, model: str | None = None) -> dict[str, float]:
        """The served model's generation_config.json sampling fields (its executors' heartbeats
        carry them): `model` by name, or the one served."""
        infos = self.models()
        info = next((i for i in infos if i.model == model), infos[0] if infos else None)
        return info.sampling_defaults if info is not None else {}

    def models(self) -> list[ExecutorInfo]:
        now = time.monotonic()
        seen: dict[str, ExecutorInfo] = {}
        for t, info in self._executors.values():
            if now - t <= self.scheduler_timeout_s and info.max_model_len > 0:
                seen.setdefault(info.model, info)
        return list(seen.values())

    async def watch(self) -> None:
        """Fail the streams of a scheduler that stopped beating, and those whose end was lost."""
        while True:
            await asyncio.sleep(min(0.5, self.scheduler_timeout_s / 4))
            now = time.monotonic()
            if not self.bus.settled(self.scheduler_timeout_s):
                continue     # cut off from NATS ourselves: the beats we missed say nothing
            silent: dict[str, list[tuple[str, InboxStream]]] = {}
            for rid, (sched, stream) in list(self._streams.items()):
                last = self._schedulers.get(sched)
                if last is not None and now - last > self.scheduler_timeout_s:
                    stream.fail(ServiceUnavailable(f"scheduler {sched} stopped responding; request "
                                                   f"{ids_.unscoped(rid)} was lost"))
                elif now - stream.heard_at > self.stall_check_s and now - stream.probed_at > self.stall_check_s:
                    stream.probed_at = now
                    silent.setdefault(sched, []).append((rid, stream))
            for sched, streams in silent.items():
                await self._probe(sched, streams)

    async def _probe(self, sched: str, streams: list[tuple[str, InboxStream]]) -> None:
        """Streams silent for stall_check_s: does their scheduler still run them? NATS delivers at
        most once, so a stream's last item can be lost; the stream then ends with a clear error
        instead of waiting for the request timeout."""
        try:
            reply = await self.bus.request(subjects.live("scheduler", sched), LiveQuery(rids=[r for r, _ in streams]),
                                           LiveReply, timeout=2, idempotent=True)
        except RadixflowError:
            return            # unreachable: its heartbeats decide
        known = set(reply.rids)
        for rid, stream in streams:
            if rid not in known and time.monotonic() - stream.heard_at > self.stall_check_s \
                    and not await stream.recover():
                stream.fail(StreamGap(f"the end of request {ids_.unscoped(rid)} was lost in transit"))

    async def _resend(self, sched: str, subject: str, seq: int) -> list | None:
        """The items of one of our streams from `seq` on, sent again by its scheduler."""
        r = await self.bus.request(subjects.resend(sched), Resend(subject=subject, seq=seq), Resent, timeout=2,
                                   idempotent=True)
        if r.found:
            self.resent_total += len(r.items)
        return r.items if r.found else None

    def generate(self, req: GenerateRequest) -> AsyncIterator[Accepted | StreamChunk]:
        """Yield Accepted, then every StreamChunk; a StreamError raises its typed error.
        Leaving early (client gone) aborts the request."""
        return self._submit(subjects.SCHEDULER_SUBMIT, req, Accepted, ids_.scoped(req.tenant, req.rid), 60,
                            lambda: self._abort(req.rid, req.tenant))

    def program(self, req: ProgramRequest) -> AsyncIterator[ProgramAccepted | ProgramEvent]:
        """Yield ProgramAccepted, then every ProgramEvent up to the terminal one. Leaving early
        (client gone) cancels the program."""
        async def cancel() -> None:
            try:
                await self.program_op("cancel", ProgramQuery(id=req.id, tenant=req.tenant))
            except RadixflowError:
                pass
        return self._submit(subjects.SCHEDULER_PROGRAM, req, ProgramAccepted, ids_.scoped(req.tenant, req.id), 120,
                            cancel)

    async def _submit(self, subject: str, req, accepted: type, key: str, timeout: float,
                      abandon: Callable[[], Awaitable[None]]) -> AsyncIterator:
        """Subscribe the stream inbox, submit (accepted or refused fast), then read the stream to
        its terminal item; the owning scheduler is watched while it runs. `key` is the request's id
        scoped by its tenant (shared/ids.py)."""
        done = False
        batched = self.coalesce and isinstance(req, GenerateRequest)
        async with self.bus.open_stream(idle_timeout_s=self.request_timeout_s, batched=batched) as stream:
            req.stream_subject, req.origin = stream.subject, self.origin
            if batched:
                req.stream_batch = stream.batch_subject
            try:
                acc = await self.bus.request(subject, req, accepted, timeout=timeout)
            except (RequestTimeout, RequestLost):
                # no answer is not a refusal: it may have been accepted, and would run unseen
                await abandon()
                raise
            self._streams[key] = (acc.scheduler, stream)
            stream.refill = lambda seq, sched=acc.scheduler, subject=stream.subject: self._resend(sched, subject, seq)
            self._schedulers.setdefault(acc.scheduler, time.monotonic())
            if isinstance(acc, ProgramAccepted):
                self._owners[key] = acc.scheduler
                while len(self._owners) > KEEP_OWNERS:
                    self._owners.pop(next(iter(self._owners)))
            try:
                yield acc
                async for item in stream:
                    if isinstance(item, StreamError):
                        done = True
                        raise from_reply(ErrorReply(code=item.code, kind=item.kind, message=item.message))
                    done = item.finished
                    yield item
            finally:
                self._streams.pop(key, None)
                if not done:
                    await abandon()

    async def program_op(self, op: str, q: ProgramQuery) -> ProgramInfo:
        """GET or cancel a program at its scheduler (known when this gateway submitted it), else ask
        every scheduler: only the owner answers, so silence is a 404."""
        owner = self._owners.get(ids_.scoped(q.tenant, q.id))
        if owner is not None:
            try:
                return await self.bus.request(subjects.program_op(owner, op), q, ProgramInfo, timeout=10,
                                              idempotent=True)
            except ServiceUnavailable:
                pass       # that scheduler is gone; another may have it (it never does today: programs live in one)
        subject = subjects.PROGRAM_GET if op == "get" else subjects.PROGRAM_CANCEL
        try:
            return await self.bus.request(subject, q, ProgramInfo, timeout=1.0, idempotent=True)
        except RequestTimeout:
            raise NotFound(f"no program {q.id!r}", param="id") from None

    def fail_all(self, err: Exception) -> None:
        """End every stream still open with `err` (the gateway stops)."""
        for _, stream in list(self._streams.values()):
            stream.fail(err)

    async def _abort(self, rid: str, tenant: str) -> None:
        try:
            await self.bus.publish(subjects.SCHEDULER_ABORT, AbortRequest(rids=[rid], tenant=tenant))
        except RadixflowError:
            pass

    async def complete(self, req: GenerateRequest) -> Result:
        res = Result(rid=req.rid)
        gen = self.generate(req)
        try:
            async for item in gen:
                if isinstance(item, Accepted):
                    res.accepted(item)
                else:
                    res.add(item)
        finally:
            await gen.aclose()
        res.choices.sort(key=lambda c: c.index)
        return res

    async def token_texts(self, ids: list[int], known: dict[int, str] | None = None) -> dict[int, str]:
        """Each token's own text (special tokens included), for logprobs: those not in `known`, in
        requests of TEXTS_PER_REQUEST tokens (a long output with 20 alternatives per token holds
        thousands of distinct ids; one message of them all could pass the bus's max_payload)."""
        known = {} if known is None else known
        uniq = sorted(set(ids) - known.keys())
        parts = [uniq[i:i + TEXTS_PER_REQUEST] for i in range(0, len(uniq), TEXTS_PER_REQUEST)]
        replies = await asyncio.gather(*(self.bus.request(subjects.TOKENIZER_DETOKENIZE, DetokenizeRequest(items=[
            DetokItem(ids=[t], prefix_offset=0, read_offset=0, skip_special_tokens=False, flush=True) for t in part]),
            DetokenizeReply, timeout=10, idempotent=True) for part in parts))
        for part, reply in zip(parts, replies):
            known.update((t, d.text) for t, d in zip(part, reply.items))
        return known

    async def detokenize(self, ids: list[int]) -> str:
        """The text of a whole token sequence (special tokens kept)."""
        reply = await self.bus.request(subjects.TOKENIZER_DETOKENIZE, DetokenizeRequest(items=[DetokItem(
            ids=ids, prefix_offset=0, read_offset=0, skip_special_tokens=False, flush=True)]), DetokenizeReply,
            timeout=10, idempotent=True)
        return reply.items[0].text


def new_rid() -> str:
    return secrets.token_hex(16)
