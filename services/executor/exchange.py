"""The executor's exchange with the page authority (the radix service), once per step: the
batcher's RadixStep goes out (releases, progress, growth, admissions) and its reply is applied
(grants start sequences, grown pages extend page tables). With overlap the message is sent before
the step computes and its answer read after. When the authority is down or slow the message
goes out again with the next, and waiting requests fail after radix_wait_s; when it restarted
and forgot this pool, what running requests hold is registered with it again (_rejoin).

A mixin of Engine (engine.py), which owns the batcher, the page authority and the live table;
what it uses of its host is annotated on the class.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import msgspec

from radixflow.shared import log
from radixflow.shared.errors import NotFound, RadixflowError, RequestTimeout, ServiceUnavailable
from radixflow.shared.histogram import Histogram
from radixflow.shared.messages import HeldPages, RadixRegister, RadixStep, SeqOutput

from .batcher import Batcher
from .engine_config import EngineConfig
from .pages import PageAuthority
from .sequence import Sequence, Status
from .tiers import KVTiers

_log = log.get("executor")


class RadixExchange:
    # the host's (Engine)
    cfg: EngineConfig
    batcher: Batcher
    pages: PageAuthority
    tiers: KVTiers | None
    page_size: int
    counters: dict[str, int]
    queue_seconds: Histogram
    preempted: int
    _lock: threading.Lock
    _live: dict[str, Sequence]
    _register: RadixRegister
    _error: Callable[[Sequence, int, str], tuple[str, SeqOutput]]
    # this exchange's own, set up by the host: a sync asked for (Engine.sync), since when radix has
    # not answered, and whether the last reply deferred candidates for a page being computed
    _sync: bool
    _radix_down_since: float
    _shared_wait: bool

    def _exchange(self) -> list[tuple[str, SeqOutput]]:
        pending = self._send()
        return self._receive(*pending) if pending else []

    def _send(self) -> tuple | None:
        msg = self.batcher.radix_message()
        with self._lock:
            sync, self._sync = self._sync, False
        # what the KV tiers gained and lost rides the step's message (one of its own if none goes)
        tiers = self.tiers.report() if self.tiers is not None else None
        if msg is None and (sync or tiers):
            msg = RadixStep(pool=self.cfg.pool, budget=0, max_admit=0)
        if tiers:
            msg = msgspec.structs.replace(msg, tier_pages_added=tiers[0], tier_pages_dropped=tiers[1],
                                          tier_states_added=tiers[2], tier_states_dropped=tiers[3])
        return None if msg is None else (msg, self.pages.send(msg))

    def _unsent(self, msg: RadixStep) -> None:
        """A step radix may not have applied: its tier report goes again (adding and dropping a key
        twice changes nothing; the batcher's part is resent by batcher.resend or fails its requests)."""
        if self.tiers is not None:
            self.tiers.unreported(msg.tier_pages_added + msg.tier_pages_dropped,
                                  msg.tier_states_added + msg.tier_states_dropped)

    def _receive(self, msg, reply_of) -> list[tuple[str, SeqOutput]]:
        try:
            reply = reply_of()
        except NotFound:
            return self._rejoin()
        except (ServiceUnavailable, RequestTimeout) as e:
            self._unsent(msg)
            # radix is down or slow (a restart takes seconds): what the message said goes out again
            # with the next one, and waiting requests wait, for up to radix_wait_s; then they fail
            now = time.monotonic()
            self._radix_down_since = self._radix_down_since or now
            self.batcher.resend(msg)
            if now - self._radix_down_since < self.cfg.radix_wait_s:
                if not self.batcher.running:
                    time.sleep(0.1)     # nothing to compute meanwhile: do not spin on a dead subject
                return []
            cands = {c.rid for c in msg.candidates}
            lost = [s for s in self.batcher.waiting if s.rid in cands]
            return [self._error(s, e.code, f"no KV pages: {e.message}") for s in lost]
        except RadixflowError as e:
            self._unsent(msg)
            cands = {c.rid for c in msg.candidates}
            lost = [s for s in self.batcher.waiting if s.rid in cands]
            return [self._error(s, e.code, f"no KV pages: {e.message}") for s in lost]
        self._radix_down_since = 0.0
        self._shared_wait = any(d.reason == "shared-prefix" for d in reply.deferred)
        started = self.batcher.apply(reply.grants, retry=any(d.reason in ("budget", "shared-prefix", "unknown")
                                                             for d in reply.deferred), deferred=reply.deferred)
        if self.tiers is not None:
            # what granted pages and slots held goes to the host tier before anything overwrites it;
            # then the new requests load what the tiers have of their prompts
            ps = self.page_size
            self.tiers.reused([p for s in started for p in s.pages[s.cached_len // ps:]]
                              + [p for pages in reply.grown.values() for p in pages],
                              [x for s in started for x in (s.state_slot, s.tail_slot, *s.checkpoints.values())],
                              started)
            for s in started:
                s.loaded_len = self.tiers.load(s)
        for rid, pages in reply.grown.items():
            seq = self._live.get(rid)
            if seq is not None and seq.status == Status.RUNNING and seq.growing:
                seq.pages = seq.pages + pages
                seq.slots, seq.growing = None, False
        for rid in reply.short:
            seq = self._live.get(rid)
            if seq is not None:
                seq.growing = False      # asked again next step: pages may have come back by then
        now = time.monotonic()
        for s in started:
            if s.arrived:
                self.queue_seconds.observe(now - s.arrived)
                s.arrived = 0.0
            # a preempted sequence's resumption counts what it computes again, not a new request
            self.counters["prompt_tokens_total"] += s.prefill_len
            self.counters["cached_tokens_total"] += s.cached_len + s.loaded_len
            self.counters["requests_total"] += not s.resume_len
        return []

    def _make_room(self) -> None:
        """A decoding sequence whose next token has no page (its growth was refused, or has not
        come back yet) drops its draft; if that is not enough it is preempted."""
        if self.cfg.decode_reserve <= 0:
            return
        for s in list(self.batcher.running):
            if s.computed_len < s.prefill_len:
                continue
            room = len(s.pages) * self.page_size
            if len(s.tokens) + len(s.draft) > room:
                s.draft = s.draft[:max(room - len(s.tokens), 0)]
                s.certain = min(s.certain, len(s.draft))
            if len(s.tokens) > room:
                self.batcher.preempt(s)
                self.preempted += 1

    def _rejoin(self) -> list[tuple[str, SeqOutput]]:
        """The authority restarted and forgot our pool. What our running requests hold is still here:
        register again with it, so that they go on (the new authority caches their computed
        prefixes anew and frees everything else). A request that has computed nothing of its own
        yet leans on cached pages and a checkpoint that are forgotten now: it waits again."""
        b = self.batcher
        going = [s for s in b.running if s.computed_len > s.cached_len]
        again = [s for s in b.running if s.computed_len <= s.cached_len]
        held = [HeldPages(rid=s.rid, namespace=s.namespace, tokens=s.tokens[:s.prefill_len], pages=s.pages,
                          computed=s.computed_len, quota_pages=s.quota_pages, state_slot=s.state_slot,
                          tail_slot=s.tail_slot, checkpoints=list(s.checkpoints), checkpoint_slots=list(s.checkpoints.values()))
                for s in going]
        try:
            self.batcher.known_candidates = self.pages.register(msgspec.structs.replace(self._register, held=held))
        except RadixflowError as e:
            _log.error("radix lost our pool and cannot take it back", error=e.message, requests=len(b.running))
            lost = b.fail_all()
            return [self._error(s, 503, f"the radix service restarted and lost the request's KV: {e.message}")
                    for s in lost]
        b.rejoined(again)
        if self.tiers is not None:
            self.tiers.report_all()
        self._radix_down_since = 0.0
        _log.warning("radix restarted: registered again", running=len(going), waiting_again=len(again))
        return []
