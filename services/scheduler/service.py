"""Scheduler service: request lifecycle, and the guarantee that every accepted request gets exactly
one terminal event on its stream (a finished chunk or a StreamError), whatever else fails.

    submit:  validate -> tokenize -> tenant limits -> pick executor -> track -> ExecRequest -> Accepted
    output:  StepOutput (one per executor step) -> one batched detokenize -> stop strings -> chunks
             (output.py)
    watch:   an executor without heartbeat is dead: its requests end in 503; a request past its
             deadline ends in 504 (and is aborted on its executor)
"""
from __future__ import annotations

import asyncio
import time

import msgspec

from radixflow.shared import ids as ids_, subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import SchedulerConfig, ServiceConfig
from radixflow.shared.errors import BadRequest, Overloaded, RadixflowError, RequestLost, RequestTimeout, ServiceUnavailable
from radixflow.shared.histogram import Histogram
from radixflow.shared.recent import Recent
from radixflow.shared.messages import (AbortRequest, Accepted, ChatOptions, Constraint,
                                       EncodeReply, EncodeRequest, ExecAccepted, ExecRequest, ExecutorInfo,
                                       GenerateRequest, GrammarCompile, GrammarCompiled, Heartbeat, LiveQuery, LiveReply,
                                       ProgramQuery, ProgramRequest, RadixPlace, RadixPlaceReply, Resend, Sample,
                                       StatusRequest, StepOutput,
                                       StreamError, TokenizerInfo)
from radixflow.shared.validate import check_request

from .detok import Detokenizer
from .executors import ExecutorState
from .output import OutputPath
from .programs import ProgramDriver
from .recovery import Recovery
from .disagg import Handoff, pick_prefill
from .siblings import Siblings, child_rid
from .structured import Checks, OutputCheck, check_constraint
from .routing import Candidate, Router
from .streamlog import StreamLog
from .table import RequestTable, Tracked, incremental, namespace_of
from .tenants import RETRY_AFTER_S, TenantLedger, Ticket

ENDED_KEEP_S = 2.0    # a request whose terminal item was sent this recently still counts as known (LiveQuery)


class SchedulerService(OutputPath, Actor):
    service = "scheduler"

    def __init__(self, bus: Bus, config: SchedulerConfig, service_config: ServiceConfig | None = None):
        super().__init__(bus, service_config, instance=config.instance or None)
        self.cfg = config
        self.table = RequestTable()
        self.executors: dict[str, ExecutorState] = {}
        self.siblings: dict[str, Siblings] = {}     # rid of a request with n > 1 -> its children
        self.handoffs: dict[str, Handoff] = {}      # rid of a request in its prefill stage (disagg.py)
        self.handoff_tasks: set[asyncio.Task] = set()   # ... and those being sent on to their decode executor
        self.disagg_counters = {"disagg_prefills_total": 0, "disagg_prefill_failed_total": 0}
        self.resampled_total = 0                    # structured outputs sampled again after a failed check
        self.checks = Checks()                      # the final output checks, off the event loop
        self._checking: set[asyncio.Task] = set()   # requests whose end waits for their check (output.py)
        # output.py's pass: outputs taken in and not yet sent, steps taken in since the last pass,
        # and the items of the pass under way, by the reader's StreamBatch subject
        self._unsent: dict[str, tuple] = {}
        self._absorbed = 0
        self._outbox: dict[str, list] | None = None
        self.tenants = TenantLedger(share=config.tenant_share, capacity=(config.max_queued_requests,
                                                                       config.max_queued_tokens))
        self.router = Router(config.routing, config.route_load_tokens)
        # latency as clients see it, up to this service: from acceptance to the first output, between
        # outputs (per token), to the end
        self.ttft = Histogram("time_to_first_token_seconds")
        self.itl = Histogram("inter_token_latency_seconds")
        self.e2e = Histogram("e2e_request_latency_seconds")
        self._eos: list[int] | None = None
        self.detok = Detokenizer(bus, config.local_detokenize)
        self.output_subject = subjects.scheduler_output(self.instance)
        self.route(subjects.SCHEDULER_SUBMIT, GenerateRequest, self.submit, queue="scheduler")
        # while draining, the requests in flight still need their executors' outputs and beats
        self.route(subjects.SCHEDULER_ABORT, AbortRequest, self.abort, drain_last=True)
        self.route(subjects.heartbeat("executor"), Heartbeat, self.on_executor_heartbeat, drain_last=True)
        self.route(subjects.heartbeat("scheduler"), Heartbeat, self.on_scheduler_heartbeat, drain_last=True)
        self.gateways: dict[str, float] = {}        # gateway instance -> its latest beat (monotonic)
        self.route(subjects.heartbeat("gateway"), Heartbeat, self.on_gateway_heartbeat, drain_last=True)
        self.route(self.output_subject, StepOutput, self.on_output, ordered=True, drain_last=True)
        self.programs = ProgramDriver(self)
        self.route(subjects.SCHEDULER_PROGRAM, ProgramRequest, self.programs.submit, queue="scheduler")
        self.route(subjects.PROGRAM_GET, ProgramQuery, self.programs.get_if_owner)
        self.route(subjects.PROGRAM_CANCEL, ProgramQuery, self.programs.cancel_if_owner)
        self.route(subjects.live(self.service, self.instance), LiveQuery, self.live, drain_last=True)
        self.ended = Recent(ENDED_KEEP_S)            # requests whose terminal item was sent moments ago
        self.streams = StreamLog()                   # what was sent on each stream, for a gateway that lost some
        self.route(subjects.resend(self.instance), Resend, self.resend, drain_last=True)
        self.recovery = Recovery(self)
        self.route(subjects.program_op(self.instance, "get"), ProgramQuery, self.programs.get, drain_last=True)
        self.route(subjects.program_op(self.instance, "cancel"), ProgramQuery, self.programs.cancel, drain_last=True)

    async def on_start(self) -> None:
        self.spawn("watchdog", self.recovery.watch)
        self.spawn("tokenizer-info", self._learn_tokenizer)

    async def _learn_tokenizer(self) -> None:
        """Ask the tokenizer service for its info at start, not at the first request: the local
        detokenizer starts loading now (seconds), so a tokenizer restart later does not fail the
        streams that would otherwise still detokenize through it."""
        while self._eos is None:
            try:
                await self._eos_ids()
            except RadixflowError:
                await asyncio.sleep(1.0)

    async def on_drain(self) -> None:
        while len(self.table) or self.programs.runs:
            await asyncio.sleep(0.02)

    async def on_stop(self) -> None:
        self.checks.close()

    def status(self) -> dict:
        return {"inflight": len(self.table), "programs": len(self.programs.runs),
                "executors": {k: msgspec.to_builtins(v.info) for k, v in self.executors.items()}}

    def metrics(self) -> list[Sample]:
        return [Sample(name="requests_inflight", value=len(self.table)),
                Sample(name="structured_resamples_total", value=self.resampled_total),
                Sample(name="structured_check_timeouts_total", value=self.checks.timeouts),
                Sample(name="requests_retried_total", value=self.recovery.retried_total),
                Sample(name="output_tokens_replayed_total", value=self.recovery.replayed_total)] \
            + [Sample(name=n, value=v) for n, v in self.disagg_counters.items()] + self.programs.metrics() \
            + self.tenants.samples() + self.ttft.samples() + self.itl.samples() + self.e2e.samples()

    # ------------------------------------------------------------ executors

    async def on_executor_heartbeat(self, hb: Heartbeat) -> None:
        try:
            info = msgspec.convert(hb.detail, ExecutorInfo)
        except msgspec.ValidationError:
            return
        st = self.executors.get(hb.instance)
        if st is None:
            self.executors[hb.instance] = ExecutorState(hb.instance, time.monotonic(), info)
            self.log.info("executor joined", executor=hb.instance, model=info.model)
        else:
            st.last_seen, st.info = time.monotonic(), info

    async def on_scheduler_heartbeat(self, hb: Heartbeat) -> None:
        """A peer's tenants' counts: a tenant's share holds over every instance (tenants.py)."""
        counts = hb.detail.get("tenants")
        if hb.instance != self.instance and isinstance(counts, dict):
            self.tenants.peer(hb.instance, time.monotonic(), {t: v for t, v in counts.items()
                                                              if isinstance(v, list) and len(v) == 2})

    async def on_gateway_heartbeat(self, hb: Heartbeat) -> None:
        self.gateways[hb.instance] = time.monotonic()

    def heartbeat_detail(self) -> dict:
        return {"tenants": self.tenants.heartbeat()}

    def live_executors(self) -> list[ExecutorState]:
        live = [e for e in self.executors.values() if e.info.max_model_len > 0 and not e.info.draining]
        if not live:
            raise ServiceUnavailable("no executor is available")
        return live

    async def place(self, live: list[ExecutorState], namespace: str, ids: list[int],
                    cached: dict[str, int] | None = None, tiered: dict[str, int] | None = None) -> ExecutorState:
        """Cache-aware placement (routing.py): the cached prefix each executor would reuse, as radix
        knows it, weighed against its load. With one executor there is nothing to ask; if radix
        cannot answer, what this scheduler routed recently and the load decide. `cached`, when
        given, gets radix's answer, and `tiered` how much of it is in executors' KV tiers. Prefill
        executors (disagg.py) take no request of their own."""
        live = [e for e in live if e.info.role != "prefill"] or live
        if len(live) == 1 and cached is None:
            return live[0]
        cached = {} if cached is None else cached
        if self.router.policy != "round_robin":
            try:
                reply = await self.bus.request(subjects.RADIX_PLACE, RadixPlace(
                    namespace=namespace, token_ids=ids, pools=[e.instance for e in live]), RadixPlaceReply,
                    timeout=2, idempotent=True)
                cached.update(reply.cached_tokens)
                if tiered is not None:
                    tiered.update(reply.tier_tokens)
            except RadixflowError as e:
                self.log.warning("placement without radix", error=e.message)
        # load: what this scheduler sent there and has not seen end, or the executor's own queue
        # (its beat, which counts every scheduler's requests), whichever is more
        name = self.router.pick([Candidate(e.instance, cached.get(e.instance, 0),
                                           max(e.inflight, e.info.running + e.info.waiting)) for e in live],
                                namespace, ids)
        return next(e for e in live if e.instance == name)

    # ------------------------------------------------------------ intake

    async def _eos_ids(self) -> list[int]:
        if self._eos is None:
            info = await self.bus.request(subjects.TOKENIZER_INFO, StatusRequest(), TokenizerInfo, timeout=10,
                                          idempotent=True, attempt_s=2)
            self._eos = list(info.eos_token_ids)
            self.detok.offer(info)
        return self._eos

    async def encode(self, text: str | None = None, messages=None, texts: list[str] | None = None,
                     chat: ChatOptions | None = None) -> EncodeReply:
        return await self.bus.request(subjects.TOKENIZER_ENCODE,
                                      EncodeRequest(text=text, messages=messages, texts=texts, chat=chat),
                                      EncodeReply, timeout=30, idempotent=True, attempt_s=5)

    async def compile(self, c: Constraint | None, tenant: str = "") -> tuple[str | None, OutputCheck | None]:
        """The compiled grammar's key and the final-output check of a constraint (None: unconstrained).
        A tenant whose schema's check recently ran out of time is refused it at once (its own: the
        memory is per tenant, so that it says nothing about another's schemas)."""
        if c is None:
            return None, None
        check_constraint(c)
        compiled = await self.bus.request(subjects.GRAMMAR_COMPILE, GrammarCompile(kind=c.kind, spec=c.spec),
                                          GrammarCompiled, timeout=60, idempotent=True, attempt_s=5)
        owned = f"{tenant}/{compiled.key}"
        self.checks.refuse_slow(owned)
        return compiled.key, OutputCheck(c, compiled.backend, compiled.enforcement, compiled.compile_s, key=owned,
                                         budget_s=self.cfg.check_budget_s)

    def check_room(self, n: int = 1) -> None:
        if len(self.table) + n > self.cfg.max_queued_requests:
            raise Overloaded(f"{len(self.table)} requests in flight; try again later", retry_after=RETRY_AFTER_S)

    async def submit(self, req: GenerateRequest) -> Accepted:
        check_request(req)
        self.check_room(req.n + (req.n > 1))
        client_rid, req.rid = req.rid, ids_.scoped(req.tenant, req.rid)    # from here on: the tenant's
        if req.rid in self.table:
            raise BadRequest(f"request id {client_rid!r} is already in flight", param="rid")
        live = self.live_executors()   # fail fast before tokenizing when nothing can run it
        if req.input_ids is not None:
            ids = req.input_ids
        else:
            ids = (await self.encode(text=req.text, messages=req.messages, chat=req.chat)).input_ids
            if not ids:
                raise BadRequest("the prompt tokenizes to nothing", param="text")
        ticket = self.tenants.admit(req.tenant, req.limits, len(ids) + req.sampling.max_new_tokens * req.n,
                                    now=time.monotonic(), alive_s=self.cfg.executor_timeout_s)
        try:
            grammar_key, check = await self.compile(req.constraint, req.tenant)
            namespace = namespace_of(req.cache_scope or req.tenant, req.cache_salt)
            # what each executor has cached, asked of radix when a prefill executor could take the prompt
            cached: dict[str, int] | None = {} if any(e.info.role == "prefill" for e in live) else None
            tiered: dict[str, int] = {}
            ex = await self.place(live, namespace, ids, cached, tiered)
            # counted at once: a burst's placements run concurrently, and each must see the others
            ex.inflight += req.n == 1
            deadline = time.monotonic() + self.cfg.request_timeout_s
            start = min(req.logprob_start, len(ids) - 1) if req.logprob_start >= 0 else -1   # past the end: the last
            # text made once, at the end: the executor need not publish the tokens in between
            exec_req = ExecRequest(rid=req.rid, input_ids=ids, sampling=req.sampling, namespace=namespace,
                                   quota_pages=req.limits.max_cached_pages if req.limits else 0,
                                   grammar_key=grammar_key, logprob_start=start,
                                   quiet=not incremental(req.stream, req.sampling))
            if req.n == 1:
                # an agent's fan-out reaches the executor over several ms (one event loop passes each
                # stage all of it in turn); the submissions still queued here are on their way there
                # (the only executor), and admitting without them costs a hybrid model a second
                # prefill of the preamble (no state where the siblings part). Sent once: a resample
                # or a recovery re-sends t.exec_req, which announces nothing
                burst = self.queued(subjects.SCHEDULER_SUBMIT) if len(live) == 1 else 0
                tracked = Tracked(
                    rid=req.rid, stream_subject=req.stream_subject, executor=ex.instance, prompt_tokens=len(ids),
                    sampling=req.sampling, deadline=deadline, stream=req.stream, check=check, ticket=ticket,
                    json=req.json_stream, origin=req.origin, batch=req.stream_batch,
                    prompt_ids=ids[start:] if start >= 0 else [])
                pf = None if start >= 0 or cached is None else pick_prefill(live, ex, len(ids), cached.get(ex.instance, 0),
                                                          self.cfg.disagg_min_tokens, self.cfg.disagg_max_queue)
                if pf is not None:
                    # what the decode executor's tiers hold moves too: a tier may drop it before the
                    # request arrives (the receiver skips pages its host tier still has)
                    on_device = cached.get(ex.instance, 0) - tiered.get(ex.instance, 0)
                    await Handoff(self, pf, ex, exec_req, tracked, on_device).start()
                else:
                    await self.dispatch(ex, exec_req, tracked, reserved=True, burst=burst)
            else:
                await self._fan_out(ex, req, exec_req, check, deadline, ticket)
        finally:
            self.tenants.release(ticket)   # the submission's hold; its tracked entries hold it from here on
        return Accepted(rid=client_rid, prompt_tokens=len(ids), executor=ex.instance, scheduler=self.instance,
                        grammar_backend=check.backend if check else "", enforcement=check.enforcement if check else "",
                        grammar_compile_s=check.compile_s if check else 0.0)

    async def _fan_out(self, ex: ExecutorState, req: GenerateRequest, exec_req: ExecRequest,
                       check: OutputCheck | None, deadline: float, ticket: Ticket) -> None:
        """n > 1: a prefill-only parent, then n children that the executor admits after its release
        (siblings.py). A refused parent refuses the request; a refused child fails the stream."""
        if req.rid in self.siblings or any(r in self.table for r in (child_rid(req.rid, i) for i in range(req.n))):
            raise BadRequest(f"request id {ids_.unscoped(req.rid)!r} is already in flight", param="rid")
        self._check_fits(ex, exec_req)     # the children's budget, before the parent's prefill runs for nothing
        group = Siblings(self, req.rid, req.stream_subject, req.n, req.json_stream,
                         needs_parent=exec_req.logprob_start >= 0, batch=req.stream_batch)
        ids = exec_req.input_ids
        parent_sampling = msgspec.structs.replace(req.sampling, max_new_tokens=0, logprobs=False)
        await self.dispatch(ex, msgspec.structs.replace(exec_req, sampling=parent_sampling, grammar_key=None), Tracked(
            rid=req.rid, stream_subject="", executor=ex.instance, prompt_tokens=len(ids), sampling=parent_sampling,
            deadline=deadline, stream=False, sink=group.on_parent, ticket=ticket, origin=req.origin,
            prompt_ids=exec_req.input_ids[exec_req.logprob_start:] if exec_req.logprob_start >= 0 else []))
        self.siblings[req.rid] = group

        async def child(i: int) -> None:
            seed = None if req.sampling.seed is None else req.sampling.seed + i   # distinct yet reproducible
            sampling = msgspec.structs.replace(req.sampling, seed=seed)
            rid = child_rid(req.rid, i)
            try:
                await self.dispatch(ex, msgspec.structs.replace(exec_req, rid=rid, sampling=sampling, logprob_start=-1,
                                                                after=req.rid), Tracked(
                    rid=rid, stream_subject="", executor=ex.instance, prompt_tokens=len(ids), sampling=sampling,
                    deadline=deadline, stream=req.stream, check=check, ticket=ticket, origin=req.origin,
                    sink=lambda item: group.on_child(i, item)))
            except RadixflowError as e:
                await group.on_child(i, StreamError(rid=rid, seq=0, code=e.code, kind=e.kind, message=e.message))
        await asyncio.gather(*(child(i) for i in range(req.n)))

    async def dispatch(self, ex: ExecutorState, req: ExecRequest, t: Tracked, reserved: bool = False,
                       burst: int = 0) -> None:
        """Track `t` and hand `req` to executor `ex`; raises (and tracks nothing) when it is refused.
        `reserved`: the caller already counted it in ex.inflight (right when it chose `ex`, so that
        placements made concurrently see each other's load); it is given back on failure."""
        try:
            self._check_fits(ex, req)
        except RadixflowError:
            ex.inflight -= reserved
            raise
        req.eos_token_ids, req.output_subject = await self._eos_ids(), self.output_subject
        if req.grammar_key and t.check is not None:
            req.grammar = GrammarCompile(kind=t.check.kind, spec=t.check.spec, backend=t.check.backend)
        t.exec_req = req
        try:
            self.table.add(t)    # before dispatch: an output may arrive before the executor's reply does
        except KeyError:         # the same id submitted twice at once (the check before tokenizing raced)
            ex.inflight -= reserved
            raise BadRequest(f"request id {ids_.unscoped(req.rid)!r} is already in flight", param="rid") from None
        ex.inflight += not reserved
        try:
            await self.bus.request(subjects.executor_submit(ex.instance),
                                   msgspec.structs.replace(req, burst=burst) if burst else req, ExecAccepted, timeout=40)
        except RadixflowError as e:
            # not accepted: the caller gets the error instead (unless something already forgot it,
            # which gave its executor slot back)
            if self.table.finish(req.rid) is not None:
                ex.inflight = max(0, ex.inflight - 1)
            if isinstance(e, (RequestLost, RequestTimeout)):    # it may run there all the same
                await self._abort_quietly(ex.instance, [req.rid])
            raise

    @staticmethod
    def _check_fits(ex: ExecutorState, req: ExecRequest) -> None:
        ids, limit = req.input_ids, ex.info.max_model_len
        if len(ids) + req.sampling.max_new_tokens > limit:
            raise BadRequest(f"prompt ({len(ids)} tokens) plus max_new_tokens ({req.sampling.max_new_tokens}) "
                             f"exceeds the model's context length of {limit} tokens", param="max_new_tokens")
        if max(ids) >= ex.info.vocab_size:
            raise BadRequest(f"input_ids must be < vocab size {ex.info.vocab_size}", param="input_ids")

    async def abort(self, req: AbortRequest) -> None:
        """A caller's abort: its ids, scoped by its tenant (another tenant's requests of the same ids
        are not touched)."""
        by_exec: dict[str, list[str]] = {}
        scoped = [ids_.scoped(req.tenant, rid) for rid in req.rids]
        for rid in scoped:
            if (h := self.handoffs.get(rid)) is not None:
                await h.cancel()
        rids = [r for rid in scoped for r in ([rid] + (self.siblings[rid].children if rid in self.siblings else []))]
        for rid in rids:
            t = self.table.get(rid)
            if t is not None:
                by_exec.setdefault(t.executor, []).append(rid)
        for ex, rids in by_exec.items():
            await self.bus.publish(subjects.executor_abort(ex), AbortRequest(rids=rids))

    # ------------------------------------------------------------ requests ended elsewhere

    async def abort_rids(self, rids: list[str]) -> None:
        """Stop these requests without a terminal event of their own (their stream already ended)."""
        for ex, gone in self.forget(rids).items():
            try:
                await self.bus.publish(subjects.executor_abort(ex), AbortRequest(rids=gone))
            except RadixflowError:
                pass

    def forget(self, rids: list[str]) -> dict[str, list[str]]:
        """Stop tracking requests without a terminal event (their program already ended them);
        returns them by executor, to be aborted there."""
        by_exec: dict[str, list[str]] = {}
        for rid in rids:
            t = self.table.finish(rid)
            if t is not None:
                self._release(t)
                by_exec.setdefault(t.executor, []).append(rid)
        return by_exec

    async def live(self, q: LiveQuery) -> LiveReply:
        """The asked requests and programs this scheduler still has, or ended moments ago."""
        return LiveReply(rids=[r for r in q.rids if r in self.table or r in self.siblings or r in self.handoffs
                               or r in self.programs.runs
                               or r in self.ended])

    async def _abort_quietly(self, executor: str, rids: list[str]) -> None:
        try:
            await self.bus.publish(subjects.executor_abort(executor), AbortRequest(rids=rids))
        except RadixflowError:
            pass
