"""ProgramDriver: runs programs inside the scheduler service. The graph (graph.py) and the policy
(policy.py) decide; this does the I/O: tokenize, compile grammars, dispatch node requests through
the scheduler's own request path, and stream ProgramEvents to the caller.

    submit:  validate -> tokenize static texts (one batch) -> compile grammars -> ProgramAccepted
    advance: every ready node -> its jobs -> the executor holding its parent (placement otherwise)
    item:    a node request's stream items (Tracked.sink) -> node state -> events -> advance
    end:     every node done, failed or cancelled -> one terminal event; pins released

A program has one deadline; a node's request that fails fails its dependents with the cause, and
the program still returns every other node's result. Exactly one terminal event per program.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Protocol

from structlog.stdlib import BoundLogger

from radixflow.shared import ids as ids_, subjects, validate
from radixflow.shared.bus import Bus
from radixflow.shared.config import SchedulerConfig
from radixflow.shared.errors import BadRequest, NotFound, RadixflowError
from radixflow.shared.messages import (AbortRequest, CacheHints, ChatOptions, Constraint, Demote, EncodeReply,
                                       ExecRequest, ProgramAccepted, ProgramEvent, ProgramInfo, ProgramQuery,
                                       ProgramRequest, Sample, StreamChunk, StreamError)

from .executors import ExecutorState
from .graph import Limits, Node, ProgramGraph, constraint_of
from .policy import Job, ProgramPolicy
from .streamlog import StreamLog
from .structured import OutputCheck
from .table import Tracked, namespace_of
from .tenants import TenantLedger, Ticket

KEEP_ENDED = 256       # finished programs answered by GET, most recent first


class ProgramRun:
    """One program in flight, owned by one scheduler instance."""

    def __init__(self, req: ProgramRequest, graph: ProgramGraph, namespace: str, timeout_s: float):
        self.id, self.subject, self.stream, self.tenant = req.id, req.stream_subject, req.stream, req.tenant
        self.key = ids_.scoped(req.tenant, req.id)    # the caller's id is its own; ours is scoped by tenant
        self.json = req.json_stream
        self.origin = req.origin
        self.accepted_at = time.monotonic()
        self.graph = graph
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.seq = 0
        self.state = "running"
        self.grammars: dict[str, tuple[str, OutputCheck]] = {}      # node -> compiled key, output check
        self.requests: dict[str, tuple[Node, Job]] = {}             # live request id -> its node and job
        self.pins: dict[str, list[tuple[str, str]]] = {}            # node -> (pool, key) of its pins
        self.choices: dict[str, dict[int, tuple[list[float], int, int]]] = {}  # select -> choice -> (lps, prompt, cached)
        self.choice_ids: dict[str, list[list[int]]] = {}
        self.ended = False
        self.quota_pages = req.limits.max_cached_pages if req.limits else 0
        self.ticket: Ticket | None = None    # the program is one request to its tenant's limits

    @staticmethod
    def budget(graph: ProgramGraph) -> int:
        """What the tenant's limits count: every node's tokens known at submission plus every token
        it may generate (joins' and choices' texts, known only later, are left out)."""
        return sum(len(n.own_ids or ()) + (n.spec.gen.max_tokens if n.spec.gen else 0) for n in graph.order)

    def rid(self, n: Node, job: Job) -> str:
        return f"{self.key}/{n.id}{job.suffix}"

    def info(self) -> ProgramInfo:
        return ProgramInfo(id=self.id, state=self.state, nodes=[self.graph.result(n) for n in self.graph.order])


class Scheduler(Protocol):
    """What the driver needs of its scheduler (SchedulerService, service.py): intake, placement and
    dispatch of the nodes' requests, as for any other request."""
    bus: Bus
    cfg: SchedulerConfig
    instance: str
    log: BoundLogger
    executors: dict[str, ExecutorState]
    tenants: TenantLedger
    streams: StreamLog

    def check_room(self, n: int = 1) -> None: ...

    def live_executors(self) -> list[ExecutorState]: ...

    async def encode(self, text: str | None = None, messages=None, texts: list[str] | None = None,
                     chat: ChatOptions | None = None) -> EncodeReply: ...

    async def compile(self, c: Constraint | None, tenant: str = "") -> tuple[str | None, OutputCheck | None]: ...

    async def place(self, live: list[ExecutorState], namespace: str, ids: list[int],
                    cached: dict[str, int] | None = None) -> ExecutorState: ...

    async def dispatch(self, ex: ExecutorState, req: ExecRequest, t: Tracked, reserved: bool = False,
                       burst: int = 0) -> None: ...

    def forget(self, rids: list[str]) -> dict[str, list[str]]: ...


class ProgramDriver:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.policy = ProgramPolicy()
        self.runs: dict[str, ProgramRun] = {}
        self.ended: OrderedDict[str, tuple[str, ProgramInfo]] = OrderedDict()   # id -> (tenant, info)
        self._tasks: set[asyncio.Task] = set()
        self.counters = {"programs_total": {}, "program_nodes_total": {}, "program_parent_prefills_saved_total": 0,
                         "program_parent_tokens_reused_total": 0}

    @property
    def log(self):
        return self.sched.log

    # ------------------------------------------------------------ intake

    async def submit(self, req: ProgramRequest) -> ProgramAccepted:
        if req.tenant == "" or "/" in req.tenant:
            raise BadRequest("tenant must be a non-empty name without '/'", param="tenant")
        validate.check_stream_subject(req.stream_subject)
        key = ids_.scoped(req.tenant, req.id)
        if key in self.runs or key in self.ended:
            raise BadRequest(f"program id {req.id!r} is already in use", param="id")
        self.sched.check_room()
        cfg = self.sched.cfg
        graph = ProgramGraph(req.nodes, Limits(max_nodes=cfg.max_program_nodes, max_tokens=cfg.max_program_tokens))
        live = self.sched.live_executors()
        for n in graph.order:
            if n.spec.input_ids is not None:
                n.own_ids = list(n.spec.input_ids)
            elif not n.needs_late_text:
                n.text = n.spec.text
        texts = [n for n in graph.order if n.own_ids is None and not n.needs_late_text]
        if any(n.text for n in texts):
            batch = (await self.sched.encode(texts=[n.text for n in texts])).batch
            for n, ids in zip(texts, batch):
                n.own_ids = ids
        for n in texts:
            n.own_ids = n.own_ids or []
            if n.spec.parent is None and not n.own_ids:
                raise BadRequest(f"node {n.id!r}: its text tokenizes to nothing", param="nodes")
        graph.check_tokens(min(e.info.max_model_len for e in live), min(e.info.vocab_size for e in live))
        run = ProgramRun(req, graph, namespace_of(req.cache_scope or req.tenant, req.cache_salt),
                         req.timeout_s if req.timeout_s > 0 else cfg.request_timeout_s)
        run.ticket = self.sched.tenants.admit(req.tenant, req.limits, ProgramRun.budget(graph), param="nodes",
                                              now=time.monotonic(), alive_s=cfg.executor_timeout_s)
        try:
            await self._compile(run)
        except BaseException:
            self.sched.tenants.release(run.ticket)
            raise
        self.runs[run.key] = run
        self._spawn(self.advance(run))
        return ProgramAccepted(id=run.id, scheduler=self.sched.instance, nodes=len(graph.nodes))

    async def _compile(self, run: ProgramRun) -> None:
        """Every distinct constraint once, concurrently; a bad one is a 400 naming its node."""
        gens = [(n, constraint_of(n.spec.gen)) for n in run.graph.order if n.spec.gen is not None]
        distinct = {(c.kind, c.spec): c for _, c in gens if c is not None}
        keys = list(distinct)
        results = await asyncio.gather(*(self.sched.compile(distinct[k], run.tenant) for k in keys), return_exceptions=True)
        by_key = dict(zip(keys, results))
        for n, c in gens:
            if c is None:
                continue
            r = by_key[(c.kind, c.spec)]
            if isinstance(r, RadixflowError):
                err = type(r)(f"node {n.id!r}: {r.message}", param="nodes")
                err.code, err.kind = r.code, r.kind
                raise err
            if isinstance(r, BaseException):
                raise r
            run.grammars[n.id] = r

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ dispatch

    async def advance(self, run: ProgramRun) -> None:
        """Dispatch every ready node at once: the children of a parent arrive together and share batches."""
        if run.ended:
            return
        ready = run.graph.ready()
        for n in ready:
            n.state = "running"      # before any await: a concurrent advance must not dispatch it again
        await asyncio.gather(*(self._start(run, n) for n in ready))
        await self._maybe_end(run)

    async def _start(self, run: ProgramRun, n: Node, after: str = "") -> None:
        try:
            if n.own_ids is None:                    # a join: its text names outputs that now exist
                n.text = run.graph.resolve(n)
                n.own_ids = (await self.sched.encode(text=n.text)).input_ids if n.text else []
            choice_ids = None
            if n.kind == "select":
                texts = [run.graph.resolve_choice(n, c) for c in n.spec.select.choices]
                choice_ids = (await self.sched.encode(texts=texts)).batch
                if not all(choice_ids):
                    raise BadRequest("a select choice tokenizes to nothing", param="nodes")
                run.choice_ids[n.id], run.choices[n.id] = choice_ids, {}
            jobs = [replace(j, after=after) for j in self.policy.jobs(run.graph, n, choice_ids)]
            if not jobs[0].input_ids:
                raise BadRequest("the node's prompt is empty", param="nodes")
            ex = await self._executor(run, n, jobs[0].input_ids)
            if n.state != "running":
                return                               # cancelled or failed while we tokenized
            n.executor = ex.instance
            ex.inflight += len(jobs)                 # now: placements made meanwhile see this load
            await self._emit(run, ProgramEvent(program=run.id, seq=0, kind="started", node=n.id))
            await asyncio.gather(*(self._send(run, n, job, ex) for job in jobs))
            early = self.policy.early_children(n) if n.state == "running" else []
            for c in early:
                c.state = "running"
            await asyncio.gather(*(self._start(run, c, after=run.rid(n, jobs[0])) for c in early))
        except RadixflowError as e:
            await self._node_failed(run, n, e.code, e.message)
        except Exception as e:   # a bug: the node fails with it, the program still ends
            self.log.error("program node dispatch crashed", program=run.id, node=n.id, error=repr(e), exc_info=e)
            await self._node_failed(run, n, 500, f"internal error: {type(e).__name__}: {e}")

    async def _executor(self, run: ProgramRun, n: Node, ids: list[int]):
        """The executor holding the parent: children never scatter away from their prefix."""
        live = self.sched.live_executors()
        if n.spec.parent:
            home = run.graph.nodes[n.spec.parent].executor
            for e in live:
                if e.instance == home:
                    return e
        return await self.sched.place(live, run.namespace, ids)

    async def _send(self, run: ProgramRun, n: Node, job: Job, ex) -> None:
        if n.state != "running":
            ex.inflight -= 1                         # the reservation made in _start
            return
        rid = run.rid(n, job)
        key, check = run.grammars.get(n.id, (None, None))
        stream = run.stream and n.kind == "gen"
        t = Tracked(rid=rid, stream_subject="", executor=ex.instance, prompt_tokens=len(job.input_ids),
                    sampling=job.sampling, deadline=run.deadline + 2, stream=stream, check=check,
                    sink=lambda item: self._on_item(run, n, job, item))
        remaining = max(run.deadline - time.monotonic(), 1.0)
        req = ExecRequest(rid=rid, input_ids=job.input_ids, sampling=job.sampling, namespace=run.namespace,
                          checkpoint_at=job.checkpoint_at, grammar_key=key, priority=job.priority,
                          pin=rid if job.pin else "", pin_ttl_s=remaining + 5, logprob_start=job.logprob_start,
                          after=job.after, quota_pages=run.quota_pages)
        run.requests[rid] = (n, job)
        if job.pin:
            n.pinned = True
            run.pins.setdefault(n.id, []).append((ex.instance, rid))
        try:
            await self.sched.dispatch(ex, req, t, reserved=True)
        except RadixflowError:
            run.requests.pop(rid, None)
            raise

    # ------------------------------------------------------------ a node's stream items

    async def _on_item(self, run: ProgramRun, n: Node, job: Job, item: StreamChunk | StreamError) -> None:
        try:
            await self._item(run, n, job, item)
        except Exception as e:   # never let a program's bug break the scheduler's output loop
            self.log.error("program item handling crashed", program=run.id, node=n.id, error=repr(e), exc_info=e)
            await self._node_failed(run, n, 500, f"internal error: {type(e).__name__}: {e}")

    async def _item(self, run: ProgramRun, n: Node, job: Job, item: StreamChunk | StreamError) -> None:
        rid = run.rid(n, job)
        if rid not in run.requests or n.terminal:
            return
        if isinstance(item, StreamError):
            run.requests.pop(rid, None)
            await self._node_failed(run, n, item.code, item.message)
            return
        if not n.admitted and n.kind != "select":
            n.admitted = True        # an output means the executor admitted it: its lock holds the parent's path
            await self._unpin(run)
        if n.kind == "gen":
            n.output += item.text
            n.output_ids.extend(item.token_ids)
            if item.text and run.stream:
                await self._emit(run, ProgramEvent(program=run.id, seq=0, kind="delta", node=n.id, text=item.text))
        if not item.finished:
            return
        run.requests.pop(rid, None)
        u = item.usage
        if n.kind == "select":
            run.choices[n.id][job.choice] = (item.input_logprobs, u.prompt_tokens if u else 0, u.cached_tokens if u else 0)
            if len(run.choices[n.id]) < len(run.choice_ids[n.id]):
                return
            await self._selected(run, n)
        else:
            n.prompt_tokens, n.cached_tokens = (u.prompt_tokens, u.cached_tokens) if u else (len(job.input_ids), 0)
            n.finish_reason, n.matched_stop = item.finish_reason, item.matched_stop
            if item.finish_reason == "stop" and isinstance(item.matched_stop, int) and n.output_ids \
                    and n.output_ids[-1] == item.matched_stop:
                n.completion_tokens = len(n.output_ids)
                n.output_ids = n.output_ids[:-1]     # children continue the text, not the end-of-turn token
        await self._node_done(run, n)

    async def _selected(self, run: ProgramRun, n: Node) -> None:
        got = run.choices[n.id]
        winner, n.scores = self.policy.choose([got[i][0] for i in range(len(got))])
        ids = run.choice_ids[n.id]
        n.output_ids = ids[winner]
        n.output = run.graph.resolve_choice(n, n.spec.select.choices[winner])
        n.prompt_tokens = sum(p for _, p, _ in got.values())
        n.cached_tokens = sum(c for _, _, c in got.values())
        n.finish_reason = "stop"
        # the losing choices and the speculative branches they named are evicted first (their pins
        # go before the demotion, or the lock would stop it)
        losers = [i for i in range(len(ids)) if i != winner]
        lost_keys = {f"{run.key}/{n.id}#{i}" for i in losers}
        pins = run.pins.get(n.id, [])
        run.pins[n.id] = [p for p in pins if p[1] not in lost_keys]
        await self._hint(n.executor, unpins=[k for _, k in pins if k in lost_keys], demotes=[
            Demote(namespace=run.namespace, token_ids=n.prompt_ids + ids[i], keep=len(n.prompt_ids)) for i in losers])
        for b in self.policy.discarded_branches(run.graph, n, winner):
            b.discarded = True
            await self._emit(run, ProgramEvent(program=run.id, seq=0, kind="discarded", node=b.id,
                                               result=run.graph.result(b)))
            await self._hint(b.executor, demotes=[Demote(namespace=run.namespace, token_ids=b.full_ids,
                                                         keep=len(run.graph.prefix_ids(b)))])

    async def _node_done(self, run: ProgramRun, n: Node) -> None:
        n.state, n.admitted = "done", True
        if not n.completion_tokens:
            n.completion_tokens = len(n.output_ids) if n.kind == "gen" else 0
        if n.spec.parent:
            p = run.graph.nodes[n.spec.parent]
            ps = self.sched.executors[n.executor].info.page_size if n.executor in self.sched.executors else 16
            if n.cached_tokens >= (len(p.full_ids) - 1) // ps * ps > 0:
                self.counters["program_parent_prefills_saved_total"] += 1
            self.counters["program_parent_tokens_reused_total"] += min(n.cached_tokens, len(p.full_ids))
        await self._ended_nodes(run, [n])
        self._spawn(self.advance(run))

    async def _node_failed(self, run: ProgramRun, n: Node, code: int, message: str) -> None:
        await self._ended_nodes(run, run.graph.end(n, "failed", code, message))

    async def _ended_nodes(self, run: ProgramRun, nodes: list[Node]) -> None:
        """Nodes that just ended (done, failed, cancelled): stop their requests, tell the caller,
        release pins nobody needs any more, and end the program when nothing is left."""
        ended = {n.id for n in nodes if n.state != "done"}
        rids = [rid for rid, (n, _) in run.requests.items() if n.id in ended]
        for rid in rids:
            run.requests.pop(rid, None)
        for ex, ex_rids in self.sched.forget(rids).items():
            await self._publish(subjects.executor_abort(ex), AbortRequest(rids=ex_rids, discard=True))
        for n in nodes:
            c = self.counters["program_nodes_total"]
            c[n.state] = c.get(n.state, 0) + 1
            await self._emit(run, ProgramEvent(program=run.id, seq=0, kind="finished", node=n.id,
                                               result=run.graph.result(n)))
        await self._unpin(run)
        await self._maybe_end(run)

    # ------------------------------------------------------------ pins

    async def _unpin(self, run: ProgramRun) -> None:
        for n in run.graph.unpinnable():
            n.pinned = False
            await self._unpin_keys(run.pins.pop(n.id, []))

    async def _unpin_keys(self, pins: list[tuple[str, str]]) -> None:
        by_pool: dict[str, list[str]] = {}
        for pool, key in pins:
            by_pool.setdefault(pool, []).append(key)
        for pool, keys in by_pool.items():
            await self._hint(pool, unpins=keys)

    async def _hint(self, executor: str, unpins: list[str] = (), demotes: list[Demote] = ()) -> None:
        """Through the executor, so they reach radix after the releases that made the pins."""
        if executor and (unpins or demotes):
            await self._publish(subjects.executor_hints(executor), CacheHints(unpins=list(unpins),
                                                                             demotes=list(demotes)))

    # ------------------------------------------------------------ the end, cancel, deadline

    async def _maybe_end(self, run: ProgramRun) -> None:
        if run.ended or not run.graph.finished:
            return
        run.ended = True
        self.runs.pop(run.key, None)
        if run.ticket is not None:
            self.sched.tenants.release(run.ticket)
        for n in run.graph.nodes.values():
            n.pinned = False
        await self._unpin_keys([p for pins in run.pins.values() for p in pins])
        run.pins.clear()
        if run.state == "running":
            run.state = "finished"
        c = self.counters["programs_total"]
        c[run.state] = c.get(run.state, 0) + 1
        self.ended[run.key] = (run.tenant, run.info())
        while len(self.ended) > KEEP_ENDED:
            self.ended.popitem(last=False)
        await self._emit(run, ProgramEvent(program=run.id, seq=0, kind="done", finished=True, status=run.state))

    async def cancel(self, q: ProgramQuery) -> ProgramInfo:
        run = self._own(q)
        if run is None:
            return self._ended_info(q)
        if q.node is not None and q.node not in run.graph.nodes:
            raise NotFound(f"program {q.id!r} has no node {q.node!r}", param="node")
        if q.node is None:
            run.state = "cancelled"
        await self._ended_nodes(run, run.graph.cancel(q.node))
        return run.info()

    async def expire(self, now: float) -> None:
        for run in [r for r in self.runs.values() if now > r.deadline]:
            run.state = "timeout"
            msg = f"the program did not finish within {run.timeout_s:g}s"
            await self._ended_nodes(run, [x for n in run.graph.order for x in run.graph.end(n, "failed", 504, msg)])

    # ------------------------------------------------------------ queries

    def _own(self, q: ProgramQuery) -> ProgramRun | None:
        return self.runs.get(ids_.scoped(q.tenant, q.id))

    def _ended_info(self, q: ProgramQuery) -> ProgramInfo:
        _, info = self.ended.get(ids_.scoped(q.tenant, q.id), (None, None))
        if info is None:
            raise NotFound(f"no program {q.id!r}", param="id")
        return info

    async def get(self, q: ProgramQuery) -> ProgramInfo:
        run = self._own(q)
        return run.info() if run is not None else self._ended_info(q)

    def _owns(self, q: ProgramQuery) -> bool:
        return self._own(q) is not None or ids_.scoped(q.tenant, q.id) in self.ended

    async def get_if_owner(self, q: ProgramQuery) -> ProgramInfo | None:
        """The broadcast subject: only the owner answers (the first reply wins)."""
        return await self.get(q) if self._owns(q) else None

    async def cancel_if_owner(self, q: ProgramQuery) -> ProgramInfo | None:
        return await self.cancel(q) if self._owns(q) else None

    # ------------------------------------------------------------ output

    async def _emit(self, run: ProgramRun, ev: ProgramEvent) -> None:
        ev.seq = run.seq
        run.seq += 1
        self.sched.streams.record(run.subject, ev, ev.finished)
        await self._publish(run.subject, ev, run.json)

    async def _publish(self, subject: str, msg, as_json: bool = False) -> None:
        try:
            await self.sched.bus.publish(subject, msg, as_json)
        except RadixflowError as e:
            self.log.error("program message not sent", subject=subject, error=e.message)

    def metrics(self) -> list[Sample]:
        out = [Sample(name="programs_running", value=len(self.runs))]
        states: dict[str, int] = {}
        for run in self.runs.values():
            for n in run.graph.nodes.values():
                states[n.state] = states.get(n.state, 0) + 1
        out += [Sample(name="program_nodes", value=v, labels={"state": k}) for k, v in sorted(states.items())]
        for name in ("programs_total", "program_nodes_total"):
            out += [Sample(name=name, value=v, labels={"state": k}) for k, v in sorted(self.counters[name].items())]
        out += [Sample(name=k, value=self.counters[k]) for k in ("program_parent_prefills_saved_total",
                                                                 "program_parent_tokens_reused_total")]
        return out

