r"""Executor service: a thin actor shell around Engine.

The compute loop runs Engine.step back to back in a dedicated thread, so the event loop keeps
serving heartbeats, intake and aborts during a long prefill, and the model never waits for the
event loop between steps. Each step's outputs are handed to the loop and go out as one StepOutput
message per scheduler, never one message per token per request. Requests of a scheduler that
stops beating are aborted: nobody is left to read their output.

    compute thread:  step -> step -> step ...      (sleeps on `_wake` when idle)
                        \ call_soon_threadsafe
    event loop:       outbox -> publisher task -> NATS
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import msgspec

from radixflow.shared import subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import ExecutorConfig, ServiceConfig
from radixflow.shared.recent import Recent
from radixflow.shared.errors import RadixflowError, ServiceUnavailable
from radixflow.shared.messages import (AbortRequest, CacheHints, ExecAccepted, ExecRequest, ExecutorInfo, Heartbeat,
                                       KVPages, KVPagesStored, LiveQuery, LiveReply, MemoryReply, Replay, Replayed,
                                       Sample, SeqOutput, StatusRequest, StepOutput)

from .engine import Engine, EngineConfig
from .grammars import GrammarStore
from .memory import realized
from .models.spec import sampling_defaults
from .pages import RemotePages
from .transfer import parts


ENDED_KEEP_S = 2.0    # a request whose end was published this recently still counts as known (LiveQuery)


class ExecutorService(Actor):
    service = "executor"

    def __init__(self, bus: Bus, config: ExecutorConfig, service_config: ServiceConfig | None = None):
        super().__init__(bus, service_config, instance=config.instance or None)
        self.cfg = config
        self.engine: Engine | None = None
        self.grammars: GrammarStore | None = None
        self._wake = threading.Event()
        self._running = threading.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="executor-compute")
        self._outbox: asyncio.Queue[list[tuple[str, SeqOutput]]] = asyncio.Queue()
        self.model_name = config.served_model_name or os.path.basename(os.path.normpath(config.model))
        self.sampling_defaults = sampling_defaults(config.model) if config.sampling_defaults == "model" else {}
        self.route(subjects.executor_submit(self.instance), ExecRequest, self.submit)
        self.route(subjects.executor_abort(self.instance), AbortRequest, self.abort, drain_last=True)
        self.route(subjects.executor_hints(self.instance), CacheHints, self.hints, drain_last=True)
        self.route(subjects.executor_kv(self.instance), KVPages, self.kv_pages)
        if config.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, not {config.role!r}")
        self._transfers: set[asyncio.Task] = set()     # prefill requests' pages on their way (disaggregation)
        self._moving: set[str] = set()                 # ... their rids
        self.transfer_counters = {"kv_transfer_pages_sent_total": 0, "kv_transfer_bytes_sent_total": 0,
                                  "kv_transfer_pages_received_total": 0, "kv_transfer_bytes_received_total": 0,
                                  "kv_transfer_failed_total": 0}
        self.route(subjects.heartbeat("scheduler"), Heartbeat, self.on_scheduler_heartbeat, drain_last=True)
        self.route(subjects.MEMORY, StatusRequest, self.memory, drain_last=True)
        self.route(subjects.live(self.service, self.instance), LiveQuery, self.live, drain_last=True)
        self.route(subjects.replay(self.instance), Replay, self.replay, drain_last=True)
        self.route(subjects.heartbeat("radix"), Heartbeat, self.on_radix_heartbeat, drain_last=True)
        self._radix: str | None = None              # the radix instance last heard
        self.ended = Recent(ENDED_KEEP_S)            # requests whose last output was published moments ago
        self.draining = False
        self._owner: dict[str, str] = {}            # rid -> output subject (its scheduler)
        self._subject_seen: dict[str, float] = {}   # output subject -> last heartbeat of its scheduler

    async def on_start(self) -> None:
        cfg = self.cfg
        if cfg.num_threads:
            import torch
            torch.set_num_threads(cfg.num_threads)
        ecfg = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype, kernels=cfg.kernels,
                            page_size=cfg.page_size,
                            max_total_tokens=cfg.max_total_tokens, mem_fraction=cfg.mem_fraction,
                            max_model_len=cfg.max_model_len,
                            max_running_requests=cfg.max_running_requests, max_prefill_tokens=cfg.max_prefill_tokens,
                            mixed_chunk_tokens=cfg.mixed_chunk_tokens,
                            disable_radix_cache=cfg.disable_radix_cache, pool=self.instance,
                            burst_gap_s=cfg.burst_gap_s, burst_wait_s=cfg.burst_wait_s,
                            burst_enough_tokens=cfg.burst_enough_tokens,
                            jump_forward=cfg.jump_forward, jump_forward_policy=cfg.jump_forward_policy,
                            forced_spelling=cfg.forced_spelling,
                            overlap=cfg.overlap, radix_wait_s=cfg.radix_wait_s,
                            decode_reserve=cfg.decode_reserve,
                            state_slots=cfg.state_slots, checkpoint_interval=cfg.checkpoint_interval,
                            kv_host_pages=cfg.kv_host_pages, kv_disk_dir=cfg.kv_disk_dir,
                            kv_disk_pages=cfg.kv_disk_pages)
        loop = asyncio.get_running_loop()
        # the grammar engines' tokenizer state first (seconds at a 248k vocab): the Engine registers
        # its pool with radix, which drops a pool whose heartbeats (from after on_start) are late
        from radixflow.services.grammar.backends import make_all
        backends, unavailable = await loop.run_in_executor(None, make_all, cfg.model)
        await self._cpu_kernels(loop)
        pages = RemotePages(self.bus, loop, self.instance)
        self.engine = await loop.run_in_executor(self._thread, Engine, ecfg, pages)
        for name, why in unavailable.items():
            self.log.warning("grammar engine unavailable for this model", backend=name, error=why)
        self.grammars = GrammarStore(self.bus, backends, unavailable)
        self._running.set()
        self.spawn("compute", self._compute_loop)
        self.spawn("publisher", self._publisher)
        self.spawn("orphans", self._orphans)
        runner = self.engine.runner
        self.log.info("model loaded", model=cfg.model, device=str(runner.device), dtype=str(runner.dtype),
                      kernels=runner.kernels.name,
                      max_model_len=self.engine.max_model_len)
        if cfg.dtype == "auto" and runner.device.type == "cpu":
            from .runner import cpu_bf16_speedup
            gain = await loop.run_in_executor(self._thread, cpu_bf16_speedup)
            if gain >= 1.5:
                self.log.info("this CPU multiplies bf16 natively: --dtype bfloat16 serves faster, at bf16 precision",
                              bf16_matmul_speedup=round(gain, 2))

    async def _cpu_kernels(self, loop: asyncio.AbstractEventLoop) -> None:
        """Where the runner will pick the CPU kernels, have them before serving: the first start
        in an environment compiles them (~30 s on 2 cores), and a server that answered meanwhile
        served its first requests on the torch references, slower, while the compiler took a
        core (an agent workload's first run measured 1.0 against 0.9 s). Later starts load the
        cached build at once; where no build is possible, wait() returns None and the references
        serve, as before. Before the Engine exists: it registers with radix, which expects
        heartbeats right after."""
        from radixflow.kernels import cpu_ext
        from .runner import takes_cpu_kernels
        if takes_cpu_kernels(self.cfg.device, self.cfg.kernels) and cpu_ext.enabled():
            t0 = time.perf_counter()
            built = await loop.run_in_executor(None, cpu_ext.wait, self.cfg.kernel_build_wait_s)
            self.log.info("cpu kernels ready" if built is not None else "cpu kernels not ready: torch references serve",
                          waited_s=round(time.perf_counter() - t0, 1))

    async def drain(self, timeout_s: float | None = None) -> None:
        # schedulers stop placing here first (the flag rides a beat sent now); what they sent
        # meanwhile is still taken, then intake closes and the running requests finish
        self.draining = True
        try:
            await self.bus.publish(subjects.heartbeat(self.service), Heartbeat(
                service=self.service, instance=self.instance, ts=time.time(), detail=self.heartbeat_detail()))
        except Exception:  # disconnected: the schedulers find out from the missing beats
            pass
        # the beat's time counts against the drain's budget (a stack's services drain against one
        # deadline: this wait came on top of it)
        beat = min(0.5, 2 * self.config.heartbeat_s)
        if timeout_s is not None:
            beat = min(beat, timeout_s)
            timeout_s -= beat
        await asyncio.sleep(beat)
        await super().drain(timeout_s)

    async def on_drain(self) -> None:
        while self.engine is not None and self.engine.has_work():
            await asyncio.sleep(0.02)
        await self._outbox.join()
        if self._transfers:             # prefill requests' pages still on their way: their ends follow them
            await asyncio.gather(*self._transfers, return_exceptions=True)

    async def on_stop(self) -> None:
        self._running.clear()
        self._wake.set()
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def submit(self, req: ExecRequest) -> ExecAccepted:
        grammar = await self.grammars.get(req.grammar_key, req.grammar) if req.grammar_key else None
        self.engine.add(req, grammar)
        self._owner[req.rid] = req.output_subject
        self._subject_seen.setdefault(req.output_subject, time.monotonic())
        self._wake.set()
        return ExecAccepted(rid=req.rid)

    async def abort(self, req: AbortRequest) -> None:
        self.engine.abort(req.rids, req.discard)
        self._wake.set()

    async def hints(self, req: CacheHints) -> None:
        self.engine.hint(req)
        self._wake.set()

    async def _compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._steps, loop)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """The compute thread: step while there is work, sleep on _wake otherwise."""
        while self._running.is_set():
            self._wake.clear()   # before the check: a submit after it sets _wake and wait() returns at once
            if not self.engine.has_work():
                self._wake.wait(0.5)
                continue
            t0 = time.perf_counter()
            outs = self.engine.step()
            self.log.debug("step", ms=round((time.perf_counter() - t0) * 1e3, 2),
                           compute_ms=round(self.engine.last_compute_s * 1e3, 2), tokens=self.engine.last_tokens,
                           outputs=len(outs),
                           running=self.engine.num_running, waiting=self.engine.num_waiting)
            if outs:
                loop.call_soon_threadsafe(self._outbox.put_nowait, outs)

    async def _publisher(self) -> None:
        while True:
            outs, taken = await self._outbox.get(), 1
            # steps that came while the loop was busy go out together (a request's tokens of them
            # as one output): a loop behind the compute sends fewer messages, not a backlog
            while not self._outbox.empty():
                outs, taken = outs + self._outbox.get_nowait(), taken + 1
            try:
                await self._publish(merged(outs) if taken > 1 else outs)
            finally:
                for _ in range(taken):
                    self._outbox.task_done()

    async def live(self, q: LiveQuery) -> LiveReply:
        """The asked requests this executor still has, or whose end it published moments ago (that
        output may still be on its way)."""
        e = self.engine
        with e._lock:
            known = set(e._live) | {s.rid for s in e._new} | set(e.exports)
        known |= self._moving           # a prefill request whose pages are on their way (_transfer)
        return LiveReply(rids=[r for r in q.rids if r in known or r in self.ended])

    async def replay(self, q: Replay) -> Replayed:
        """A request's outputs from `q.offset` on, up to what was reported (a scheduler lost some to
        a NATS reconnect): from the running sequence, or one that ended moments ago."""
        e = self.engine
        with e._lock:
            seq = e._live.get(q.rid)
            got = (seq.output_ids[:seq.reported], seq.logprobs[:seq.reported], seq.top_logprobs[:seq.reported]) \
                if seq is not None else e.finished_outputs.get(q.rid)
        if got is None or q.offset < 0:
            return Replayed(found=False)
        ids, lps, tops = got
        return Replayed(found=True, token_ids=ids[q.offset:], logprobs=lps[q.offset:], top_logprobs=tops[q.offset:])

    async def memory(self, _: StatusRequest) -> MemoryReply:
        r = self.engine.runner
        report = realized(r.spec, r.plan)
        if self.engine.tiers is not None:
            report["tiers"] = {k[5:]: v for k, v in self.engine.tiers.stats().items()}
        return MemoryReply(instance=self.instance, model=self.model_name, report=report)

    async def on_radix_heartbeat(self, hb: Heartbeat) -> None:
        """A new radix instance (a restart) knows no pool, and one that dropped ours (our beats were
        late) does not list it: exchange with it now, idle or not (NotFound, then a new register)."""
        restarted = self._radix is not None and hb.instance != self._radix
        forgot = "pools" in hb.detail and self.instance not in hb.detail["pools"]
        if (restarted or forgot) and self.engine is not None:
            self.engine.sync()
            self._wake.set()
        self._radix = hb.instance

    async def on_scheduler_heartbeat(self, hb: Heartbeat) -> None:
        self._subject_seen[subjects.scheduler_output(hb.instance)] = time.monotonic()

    async def _orphans(self) -> None:
        """Abort the requests of schedulers that stopped beating."""
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now = time.monotonic()
            if not self.bus.settled(self.cfg.orphan_timeout_s):
                continue     # cut off from NATS ourselves: the beats we missed say nothing
            dead = {s for s, t in self._subject_seen.items() if now - t > self.cfg.orphan_timeout_s}
            orphans = [rid for rid, s in self._owner.items() if s in dead]
            if orphans:
                self.log.warning("aborting requests of a silent scheduler", requests=len(orphans))
                self.engine.abort(orphans)
                self._wake.set()
            for s in dead:
                if s not in self._owner.values():
                    del self._subject_seen[s]

    async def kv_pages(self, msg: KVPages) -> KVPagesStored:
        """A prefill executor's pages for our host tier (disaggregation; Engine.import_pages checks them)."""
        if self.engine is None:
            raise ServiceUnavailable("the model is still loading")
        pages, nbytes = self.engine.import_pages(msg)
        self.transfer_counters["kv_transfer_pages_received_total"] += pages
        self.transfer_counters["kv_transfer_bytes_received_total"] += nbytes
        self._wake.set()
        return KVPagesStored(pages=pages, bytes=nbytes)

    async def _transfer(self, subject: str, out: SeqOutput, export: tuple) -> None:
        """Move a finished prefill request's pages to its decode executor, then report its end (the
        scheduler sends the request there once it has it). A failed move ends it with an error, on
        which the scheduler sends the request on all the same (the decode executor computes it)."""
        target = export[0]
        self._moving.add(out.rid)
        try:
            loop = asyncio.get_running_loop()
            for part in await loop.run_in_executor(None, parts, export):      # packing: off the loop
                await self.bus.request(subjects.executor_kv(target), part, KVPagesStored, timeout=10)
                self.transfer_counters["kv_transfer_pages_sent_total"] += part.count
                self.transfer_counters["kv_transfer_bytes_sent_total"] += len(part.data) + len(part.state)
        except Exception as e:  # noqa: BLE001  whatever stops the move, the request ends once
            msg = e.message if isinstance(e, RadixflowError) else repr(e)
            self.transfer_counters["kv_transfer_failed_total"] += 1
            self.log.warning("moving pages failed", rid=out.rid, to=target, error=msg)
            out = msgspec.structs.replace(out, finish_reason="error", error_code=503,
                                          error=f"moving the prompt's KV to executor {target} failed: {msg}")
        finally:
            await self._publish([(subject, out)], hold=False)
            self._moving.discard(out.rid)

    async def _publish(self, outs: list[tuple[str, SeqOutput]], hold: bool = True) -> None:
        if hold and self.engine.exports:
            # a prefill request's end waits for its pages to reach their decode executor (_transfer)
            keep = []
            for subject, o in outs:
                export = self.engine.take_export(o.rid) if o.finished else None
                if export is None:
                    keep.append((subject, o))
                    continue
                task = asyncio.create_task(self._transfer(subject, o, export))
                self._transfers.add(task)
                task.add_done_callback(self._transfers.discard)
            outs = keep
        by_subject: dict[str, list[SeqOutput]] = defaultdict(list)
        for subject, o in outs:
            by_subject[subject].append(o)
            if o.finished:
                self._owner.pop(o.rid, None)
                self.ended.add(o.rid)
        for subject, items in by_subject.items():
            if subject:
                await self.bus.publish(subject, StepOutput(executor=self.instance, step=self.engine.steps, outputs=items))

    def info(self) -> ExecutorInfo:
        e = self.engine
        return ExecutorInfo(model=self.model_name, max_model_len=e.max_model_len if e else 0,
                            vocab_size=e.spec.vocab_size if e else 0, running=e.num_running if e else 0,
                            waiting=e.num_waiting if e else 0, page_size=e.page_size if e else self.cfg.page_size,
                            draining=self.draining, sampling_defaults=self.sampling_defaults, role=self.cfg.role,
                            takes_pages=e is not None and e.tiers is not None)

    def heartbeat_detail(self) -> dict:
        import msgspec
        return msgspec.to_builtins(self.info())

    def status(self) -> dict:
        return self.heartbeat_detail() | (self.engine.stats() if self.engine else {}) | self.transfer_counters

    def metrics(self) -> list[Sample]:
        if self.engine is None:
            return []
        st = self.engine.stats()
        names = ("prompt_tokens_total", "cached_tokens_total", "prefill_tokens_computed_total",
                 "generated_tokens_total", "requests_total", "jump_forward_drafted_total", "jump_forward_kept_total",
                 "jump_forward_certain_total",
                 "preempted_total",
                 "running", "waiting") + tuple(n for n in st if n.startswith("tier_"))
        return [Sample(name=n if n.endswith("_total") or n.startswith("tier_") else f"requests_{n}", value=st[n])
                for n in names] \
            + [Sample(name=n, value=v) for n, v in self.transfer_counters.items()] \
            + [x for h in (*self.engine.step_seconds.values(), self.engine.queue_seconds) for x in h.samples()]


def merged(outs: list[tuple[str, SeqOutput]]) -> list[tuple[str, SeqOutput]]:
    """Several steps' outputs with each request's consecutive ones joined into one: its tokens (and
    their logprobs) in order from the first one's offset, the rest as the last one says."""
    out: list[tuple[str, SeqOutput]] = []
    at: dict[str, int] = {}
    for subject, o in outs:
        i = at.get(o.rid)
        if i is None or out[i][0] != subject or out[i][1].finished \
                or out[i][1].offset + len(out[i][1].token_ids) != o.offset:
            at[o.rid] = len(out)
            out.append((subject, o))
            continue
        a = out[i][1]
        out[i] = (subject, msgspec.structs.replace(
            o, token_ids=a.token_ids + o.token_ids, offset=a.offset, logprobs=a.logprobs + o.logprobs,
            top_logprobs=a.top_logprobs + o.top_logprobs))
    return out
