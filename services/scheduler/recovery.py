"""What the scheduler does when something between an executor and a client fails, so that every
accepted request still ends exactly once:

    dead executor:  no beats, and no answer to a direct ping -> its requests that streamed nothing
                    move to another executor; the rest end in 503
    lost output:    a gap in a request's outputs (NATS delivers at most once) -> the missing tokens
                    are fetched again from the executor (Replay)
    lost end:       a request silent for stall_check_s that its executor no longer has -> 502
    deadline:       past request_timeout_s -> 504, and aborted on its executor
    gone gateway:   the gateway a request (or program) came through stopped beating -> it ends
                    (503 to a stream nobody reads) and is aborted on its executor
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

from structlog.stdlib import BoundLogger

from radixflow.shared import subjects
from radixflow.shared.bus import Bus
from radixflow.shared.config import SchedulerConfig
from radixflow.shared.errors import RadixflowError, RequestLost
from radixflow.shared.messages import (ExecAccepted, LiveQuery, LiveReply, ProgramQuery, Replay, Replayed, SeqOutput,
                                       StatusReply, StatusRequest)

from .executors import ExecutorState
from .programs import ProgramDriver
from .routing import Router
from .table import RequestTable, Tracked


class Scheduler(Protocol):
    """What recovery needs of its scheduler (SchedulerService, service.py)."""
    bus: Bus
    cfg: SchedulerConfig
    log: BoundLogger
    table: RequestTable
    executors: dict[str, ExecutorState]
    router: Router
    programs: ProgramDriver
    gateways: dict[str, float]          # gateway instance -> its latest beat (monotonic)

    async def place(self, live: list[ExecutorState], namespace: str, ids: list[int],
                    cached: dict[str, int] | None = None) -> ExecutorState: ...

    async def fail(self, t: Tracked, code: int, kind: str, message: str, abort: bool = False) -> None: ...


class Recovery:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.retried_total = 0      # requests moved off a dead executor before their first token
        self.replayed_total = 0     # output tokens fetched again after a lost output

    async def fill_gap(self, t: Tracked, o: SeqOutput, executor: str) -> bool:
        """`o` starts past what `t` has: fetch the tokens in between from the executor. False: it
        cannot say (the request must fail)."""
        have = len(t.output_ids)
        if o.offset < have:
            return False          # a repeat or a reordering: nothing here explains it
        try:
            r = await self.sched.bus.request(subjects.replay(executor), Replay(rid=t.rid, offset=have), Replayed,
                                             timeout=2, idempotent=True)
        except RadixflowError:
            return False
        if not r.found or len(r.token_ids) < o.offset - have:
            return False
        n = o.offset - have
        t.output_ids.extend(r.token_ids[:n])
        t.logprobs.extend(r.logprobs[:n])
        t.top_logprobs.extend(r.top_logprobs[:n])
        self.replayed_total += n
        return True

    async def watch(self) -> None:
        s = self.sched
        while True:
            await asyncio.sleep(min(0.5, s.cfg.executor_timeout_s / 4))
            now = time.monotonic()
            # beats missed while this process was cut off from NATS say nothing about the executors
            settled = s.bus.settled(s.cfg.executor_timeout_s)
            silent = [st for st in s.executors.values() if settled and now - st.last_seen > s.cfg.executor_timeout_s]
            # missed beats are not proof of death (this loop may have been the one that stalled):
            # ask each silent executor directly; a killed one has no responder and fails at once
            alive = await asyncio.gather(*(self._answers(st.instance) for st in silent))
            now = time.monotonic()
            for st, ok in zip(silent, alive):
                if ok:
                    st.last_seen = now
                elif s.executors.get(st.instance) is st:
                    await self._bury(st)
            if settled:
                await self._probe_silent(now)
            await s.programs.expire(now)
            if settled:
                await self._drop_orphans(now)
            for t in s.table.expired(now):
                await s.fail(t, 504, "timeout", f"request did not finish within {s.cfg.request_timeout_s:g}s", abort=True)

    async def _drop_orphans(self, now: float) -> None:
        """Requests and programs whose gateway stopped beating: nobody waits for them any more (its
        streams went with it), so they stop instead of running to their deadline."""
        s = self.sched
        after = 2 * s.cfg.executor_timeout_s     # the gateway's beats, missed for as long as an executor's kill it
        for t in s.table.orphaned(now, s.gateways, after):
            s.log.warning("request of a gone gateway dropped", rid=t.rid, gateway=t.origin)
            await s.fail(t, 503, "service_unavailable", f"gateway {t.origin} stopped responding", abort=True)
        for run in [r for r in s.programs.runs.values()
                    if r.origin and now - max(s.gateways.get(r.origin, 0.0), r.accepted_at) > after]:
            s.log.warning("program of a gone gateway cancelled", program=run.key, gateway=run.origin)
            await s.programs.cancel(ProgramQuery(id=run.id, tenant=run.tenant))

    async def _answers(self, instance: str) -> bool:
        try:
            await self.sched.bus.request(subjects.ping("executor", instance), StatusRequest(), StatusReply, timeout=1.0)
            return True
        except RequestLost:      # our own connection dropped: this says nothing about the executor
            return True
        except RadixflowError:
            return False

    async def _bury(self, st: ExecutorState) -> None:
        s, inst = self.sched, st.instance
        del s.executors[inst]
        s.router.forget(inst)
        lost = s.table.on_executor(inst)
        s.log.error("executor stopped responding", executor=inst, requests=len(lost))
        for t in lost:
            if not await self._rescue(t):
                await s.fail(t, 503, "service_unavailable", f"executor {inst} stopped responding; the request was lost")

    async def _rescue(self, t: Tracked) -> bool:
        """A request of a dead executor that has streamed nothing yet starts over on another one
        (the client sees only a later first token). False: it cannot (something was streamed, it
        belongs to a program or a group of siblings, or no other executor takes it)."""
        s = self.sched
        if t.output_ids or t.next_seq or t.sink is not None or t.exec_req is None or t.exec_req.after:
            return False
        others = [e for e in s.executors.values() if e.info.max_model_len > 0 and not e.info.draining]
        if not others:
            return False
        ex = await s.place(others, t.exec_req.namespace, t.exec_req.input_ids)
        t.executor, t.heard_at = ex.instance, time.monotonic()
        ex.inflight += 1
        try:
            await s.bus.request(subjects.executor_submit(ex.instance), t.exec_req, ExecAccepted, timeout=40)
        except RadixflowError as e:
            s.log.warning("retry on another executor failed", rid=t.rid, executor=ex.instance, error=e.message)
            return False
        self.retried_total += 1
        s.log.info("request moved to another executor", rid=t.rid, executor=ex.instance)
        return True

    async def _probe_silent(self, now: float) -> None:
        """Requests silent for stall_check_s: ask their executors whether they still run them. One
        it does not know lost its end on the way (or never got there): a clear error, not a wait
        until the deadline."""
        s = self.sched
        by_exec: dict[str, list[Tracked]] = {}
        for t in s.table.silent(now, s.cfg.stall_check_s):
            t.probed_at = now
            by_exec.setdefault(t.executor, []).append(t)
        for ex, ts in by_exec.items():
            try:
                reply = await s.bus.request(subjects.live("executor", ex), LiveQuery(rids=[t.rid for t in ts]),
                                            LiveReply, timeout=2, idempotent=True)
            except RadixflowError:
                continue      # unreachable: the watch decides whether it is dead
            known = set(reply.rids)
            for t in ts:
                if t.rid not in known and s.table.get(t.rid) is t and time.monotonic() - t.heard_at > s.cfg.stall_check_s:
                    await s.fail(t, 502, "stream_gap", f"executor {ex} no longer has the request: its output "
                                 "was lost in transit")
