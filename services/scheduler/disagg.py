"""Prefill/decode disaggregation: which requests go through a prefill executor first, and the handoff.

Executors announce a role (ExecutorInfo.role): "prefill" ones take only the prefill stage of long
prompts, "decode" and "both" take requests as ever. As Dynamo's router decides, a request is
disaggregated when what it would compute on its decode executor (its prompt less the prefix cached
there, as radix answers placement) is at least `disagg_min_tokens` and a prefill executor has a
short queue (fewer than `disagg_max_queue` requests); otherwise it prefills where it decodes.

The handoff (Handoff): a prefill-only copy of the request (rid + "/prefill", transfer_to the decode
executor) runs on the prefill executor, which moves the prompt's whole pages (and a hybrid model's
state) into the decode executor's host tier before it reports its end; then the request itself goes
to the decode executor, which finds the pages there as an evicted prefix and computes only the last
partial page. Only the pages after what the decode executor has cached (radix's answer) move. If the prefill stage fails (its executor died, the move failed), the request goes to
the decode executor all the same and computes its prompt there: a retry, not an error. A client's
abort during the prefill stage stops it, and the request is never sent on.
"""
from __future__ import annotations

import asyncio
from typing import Protocol

import msgspec
from structlog.stdlib import BoundLogger

from radixflow.shared.errors import RadixflowError
from radixflow.shared.messages import ExecRequest, StreamChunk, StreamError, Usage

from .executors import ExecutorState
from .table import Tracked


class Scheduler(Protocol):
    """What a handoff needs of its scheduler (SchedulerService, service.py)."""
    log: BoundLogger
    handoffs: dict[str, Handoff]                  # by rid, while in the prefill stage
    handoff_tasks: set[asyncio.Task]              # ... and while being sent on
    disagg_counters: dict[str, int]

    async def dispatch(self, ex: ExecutorState, req: ExecRequest, t: Tracked, reserved: bool = False,
                       burst: int = 0) -> None: ...

    async def abort_rids(self, rids: list[str]) -> None: ...

    async def send(self, t: Tracked, item: StreamChunk | StreamError) -> None: ...


def stage_rid(rid: str) -> str:
    return rid + "/prefill"


def pick_prefill(live: list[ExecutorState], decode: ExecutorState, prompt: int, cached: int,
                 min_tokens: int, max_queue: int) -> ExecutorState | None:
    """The prefill executor for a request bound for `decode`, or None to prefill there."""
    if min_tokens <= 0 or not decode.info.takes_pages or prompt - cached < min_tokens:
        return None
    prefills = [e for e in live if e.info.role == "prefill" and e is not decode]
    if not prefills:
        return None
    best = min(prefills, key=lambda e: max(e.inflight, e.info.running + e.info.waiting))
    return best if max(best.inflight, best.info.running + best.info.waiting) < max_queue else None


class Handoff:
    def __init__(self, sched: Scheduler, prefill: ExecutorState, decode: ExecutorState,
                 req: ExecRequest, tracked: Tracked, cached: int = 0):
        self.sched, self.prefill, self.decode, self.req, self.tracked = sched, prefill, decode, req, tracked
        self.cached = cached                # what the decode executor has cached of the prompt: not moved
        self.done = False

    async def start(self) -> None:
        """Dispatch the prefill stage (raises, as dispatch does, if the prefill executor refuses it)."""
        r = self.req
        sampling = msgspec.structs.replace(r.sampling, max_new_tokens=0, logprobs=False, top_logprobs=0)
        stage = msgspec.structs.replace(r, rid=stage_rid(r.rid), sampling=sampling, grammar_key=None, grammar=None,
                                        logprob_start=-1, quiet=True, transfer_to=self.decode.instance,
                                        transfer_from=self.cached)
        if self.tracked.ticket is not None:
            self.tracked.ticket.hold()      # the tenant's claim, across the gap between the two stages
        self.sched.handoffs[r.rid] = self   # before the round trip: an abort meanwhile finds it
        try:
            await self.sched.dispatch(self.prefill, stage, Tracked(
                rid=stage.rid, stream_subject="", executor=self.prefill.instance, prompt_tokens=len(r.input_ids),
                sampling=sampling, deadline=self.tracked.deadline, stream=False, sink=self._on_stage,
                origin=self.tracked.origin))
        except RadixflowError:
            if not self.done:               # (an abort meanwhile gave these back already)
                self.done = True
                self.sched.handoffs.pop(r.rid, None)
                self.decode.inflight -= 1   # counted when it was chosen (submit)
                if self.tracked.ticket is not None:
                    self.tracked.ticket.release()
            raise

    async def _on_stage(self, item: StreamChunk | StreamError) -> None:
        if isinstance(item, StreamChunk) and not item.finished or self.done:
            return
        self.done = True
        self.sched.handoffs.pop(self.req.rid, None)
        moved = isinstance(item, StreamChunk)
        self.sched.disagg_counters["disagg_prefills_total" if moved else "disagg_prefill_failed_total"] += 1
        if not moved:
            self.sched.log.warning("prefill stage failed: the decode executor computes the prompt",
                                   rid=self.req.rid, error=item.message)
        # on a task of its own: this runs inside the output pass, which the dispatch's round trip
        # (up to its timeout) would hold up for every other request
        task = asyncio.get_running_loop().create_task(self._send_on())
        self.sched.handoff_tasks.add(task)
        task.add_done_callback(self.sched.handoff_tasks.discard)

    async def _send_on(self) -> None:
        t = self.tracked
        try:
            await self.sched.dispatch(self.decode, self.req, t, reserved=True)
        except RadixflowError as e:       # refused there: the stream's one terminal event
            await self.sched.send(t, StreamError(rid=t.rid, seq=t.take_seq(), code=e.code, kind=e.kind,
                                                 message=e.message))
        finally:
            if t.ticket is not None:
                t.ticket.release()

    async def cancel(self) -> None:
        """The client aborted while the prompt was on the prefill executor: stop it there; the
        stream ends as an aborted request's does."""
        if self.done:
            return
        self.done = True
        self.sched.handoffs.pop(self.req.rid, None)
        await self.sched.abort_rids([stage_rid(self.req.rid)])
        self.decode.inflight -= 1
        t = self.tracked
        await self.sched.send(t, StreamChunk(rid=t.rid, seq=t.take_seq(), finished=True, finish_reason="abort",
                                             usage=Usage(prompt_tokens=t.prompt_tokens)))
        if t.ticket is not None:
            t.ticket.release()
