"""Engine: the executor's core loop as a plain class. A step reads as:

    self._exchange()               one message with the page authority: releases, progress, admissions
                                   (exchange.py)
    plan = batcher.schedule()      which sequences run (prefill chunks, or a decode of all)
    toks = runner.run(plan)        compute and sample
    outs = self._postprocess(...)  append tokens, report progress, finish sequences

`add` and `abort` may be called from another thread (the service's event loop) while `step` runs in
the compute thread; they are queued and applied at the start of the next step.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

from radixflow.shared import log
from radixflow.shared.errors import BadRequest
from radixflow.shared.histogram import Histogram
from radixflow.shared.messages import CacheHints, ExecRequest, KVPages, Progress, RadixRegister, SeqOutput

from radixflow.services.radix.held import pages_for
from .batcher import Batcher, Plan, candidate_tokens
from .engine_config import EngineConfig
from .exchange import RadixExchange
from .jump import Drafter
from .pages import LocalPages, PageAuthority
from .runner import ModelRunner
from .sampler import has_penalties
from .sequence import Sequence, Status
from .spelling import Speller
from .tiers import KVTiers, model_identity
from .transfer import export_pages, unpack

__all__ = ["Engine", "EngineConfig"]     # EngineConfig lives in engine_config.py

_log = log.get("executor")
FINISHED_KEEP = 2048     # finished requests whose outputs a replay can still return


class Engine(RadixExchange):
    def __init__(self, cfg: EngineConfig, pages: PageAuthority | None = None):
        from .models import ModelSpec
        spec = ModelSpec.from_dir(cfg.model)
        self.cfg = cfg
        self.max_model_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        # every running request holds a working and a tail slot; the rest hold checkpoints
        num_slots = (cfg.state_slots or 2 * cfg.max_running_requests + 64) if spec.is_hybrid else 0
        total = cfg.max_total_tokens or (self._tokens_from_memory(spec, num_slots) if cfg.mem_fraction > 0 else
                                         max(131072, 2 * self.max_model_len))
        self.page_size = cfg.page_size
        self.num_pages = pages_for(total, cfg.page_size)
        self.runner = ModelRunner(cfg.model, device=cfg.device, dtype=cfg.dtype, page_size=cfg.page_size,
                                  num_pages=self.num_pages, num_state_slots=num_slots, kernels=cfg.kernels)
        self.spec = self.runner.spec
        self.cache = not cfg.disable_radix_cache
        if cfg.warmup_tokens > 0:
            self.runner.warmup(cfg.warmup_tokens)
        if cfg.jump_forward_policy not in ("all", "certain", "auto"):
            raise ValueError(f"jump_forward_policy must be 'all', 'certain' or 'auto', not {cfg.jump_forward_policy!r}")
        if cfg.forced_spelling not in ("model", "tokenizer"):
            raise ValueError(f"forced_spelling must be 'model' or 'tokenizer', not {cfg.forced_spelling!r}")
        speller = Speller(cfg.model) if cfg.jump_forward > 0 or cfg.forced_spelling == "tokenizer" else None
        if cfg.forced_spelling == "tokenizer":
            self.runner.constrainer.speller = speller
        self.drafter = Drafter(speller, cfg.jump_forward) if cfg.jump_forward > 0 else None
        self._row_cost: float | None = None      # auto: a draft row's cost over a full row's
        self.tiers = KVTiers(self.runner.kv, self.runner.state, host_pages=cfg.kv_host_pages, disk_dir=cfg.kv_disk_dir,
                             disk_pages=cfg.kv_disk_pages, identity=model_identity(cfg.model, self.runner.kv, self.page_size)) \
            if cfg.kv_host_pages > 0 and self.cache else None
        self.pages = pages or LocalPages()
        self._register = RadixRegister(pool=cfg.pool, num_pages=self.num_pages, page_size=cfg.page_size,
                                       cache=self.cache, num_state_slots=num_slots,
                                       checkpoint_interval=cfg.checkpoint_interval or cfg.max_prefill_tokens,
                                       tier_root=self.tiers.root if self.tiers is not None else b"",
                                       tier_load_pages=self.tiers.max_load_pages if self.tiers is not None else 0)
        known = self.pages.register(self._register)
        self.batcher = Batcher(pool=cfg.pool, max_running=cfg.max_running_requests,
                               max_prefill_tokens=cfg.max_prefill_tokens, mixed_chunk_tokens=cfg.mixed_chunk_tokens,
                               max_candidate_tokens=candidate_tokens(self.spec.vocab_size),
                               decode_reserve=cfg.decode_reserve)
        self.batcher.known_candidates = known
        self._lock = threading.Lock()
        self._new: list[Sequence] = []
        self._aborts: set[str] = set()
        self._discards: set[str] = set()
        self._hints: list[CacheHints] = []
        self._imports: list[tuple] = []       # pages from another executor, for the host tier (import_pages)
        self.exports: dict[str, tuple] = {}   # rid -> what a finished transfer request moves (_finish)
        self._live: dict[str, Sequence] = {}
        self.finished_outputs: OrderedDict[str, tuple] = OrderedDict()
        self._last_arrival = 0.0
        self._expect = 0         # requests announced (ExecRequest.burst) and not arrived yet
        self._radix_down_since = 0.0
        self._sync = False
        # the last reply deferred candidates until a running request computes the page they share
        # ("shared-prefix"): see step()
        self._shared_wait = False
        self.preempted = 0       # sequences sent back to waiting for want of pages (decode_reserve)
        self.steps = 0
        self.last_compute_s = 0.0   # this step's model run and postprocessing (0: none; the rest of a step is intake and radix)
        self.last_tokens = 0        # the tokens this step's model run computed
        self.mixed_steps = 0     # prefill steps that carried decode rows
        self.overlapped = 0      # exchanges that travelled while a step computed
        self.counters = {"prompt_tokens_total": 0, "cached_tokens_total": 0, "prefill_tokens_computed_total": 0,
                         "generated_tokens_total": 0, "requests_total": 0}
        # for /metrics: a step's model time (runner and output handling) by phase, and how long a
        # request waited between arriving and getting its pages
        self.step_seconds = {p: Histogram("step_seconds", labels={"phase": p}) for p in ("prefill", "decode")}
        self.queue_seconds = Histogram("queue_seconds")

    def _tokens_from_memory(self, spec, num_slots: int) -> int:
        """The KV pool in tokens when sized by mem_fraction: that share of the device's free
        memory, less the weights about to be loaded (their files, at the serving dtype; twice on a
        CPU, for the linear kernels' packed copies), less the state slots. Too little for one
        max_model_len sequence is a clear error."""
        import os
        from .memory import dtype_bytes, free_bytes, tokens_for
        from .models.loader import weight_files
        from .runner import pick_device, pick_dtype
        device = pick_device(self.cfg.device)
        dtype = pick_dtype(device, self.cfg.dtype)
        files = weight_files(self.cfg.model)
        weights = sum(os.path.getsize(f) for f in files) * dtype_bytes(dtype) // dtype_bytes(spec.torch_dtype or "float32")
        if device.type == "cpu" and self.cfg.kernels != "torch":
            weights *= 2      # the CPU linear kernels keep a packed copy of each weight (kernels/linear/cpu.py)
        free = free_bytes(device)
        budget = int(self.cfg.mem_fraction * free) - weights
        tokens = tokens_for(spec, budget, dtype, num_slots)
        if tokens < self.max_model_len:
            raise ValueError(f"mem_fraction {self.cfg.mem_fraction} of {free / 2**30:.1f} GiB free, less "
                             f"{weights / 2**30:.2f} GiB of weights, holds {tokens} KV tokens: fewer than one "
                             f"max_model_len ({self.max_model_len}) sequence; raise it or lower max_model_len")
        _log.info("KV pool sized from free memory", mem_fraction=self.cfg.mem_fraction, free_gib=round(free / 2**30, 2),
                  weights_gib=round(weights / 2**30, 3), tokens=tokens)
        return tokens

    # ------------------------------------------------------------ intake (any thread)

    def validate(self, req: ExecRequest) -> None:
        n = len(req.input_ids)
        if n == 0:
            raise BadRequest("the prompt is empty", param="input_ids")
        if min(req.input_ids) < 0 or max(req.input_ids) >= self.spec.vocab_size:
            bad = next(t for t in req.input_ids if not 0 <= t < self.spec.vocab_size)
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})", param="input_ids")
        if n + req.sampling.max_new_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({n} tokens) plus max_new_tokens ({req.sampling.max_new_tokens}) exceeds the "
                             f"context length of {self.max_model_len} tokens", param="max_new_tokens")
        sp = req.sampling
        if sp.logit_bias and not all(0 <= t < self.spec.vocab_size for t in sp.logit_bias):
            bad = next(t for t in sp.logit_bias if not 0 <= t < self.spec.vocab_size)
            raise BadRequest(f"logit_bias token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})",
                             param="logit_bias")
        if sp.repetition_penalty <= 0:
            raise BadRequest("repetition_penalty must be positive", param="repetition_penalty")
        if not 0 <= sp.top_logprobs <= self.spec.vocab_size:
            raise BadRequest(f"top_logprobs must be in [0, {self.spec.vocab_size}]", param="top_logprobs")
        if pages_for(n + req.sampling.max_new_tokens, self.page_size) > self.num_pages:
            raise BadRequest(f"request needs {n + req.sampling.max_new_tokens} tokens of KV; the pool holds "
                             f"{self.num_pages * self.page_size}", param="max_new_tokens")

    def add(self, req: ExecRequest, grammar=None) -> None:
        """Queue a request; `grammar` (a loaded grammar of either engine, GrammarStore.get) constrains its output."""
        self.validate(req)
        seq = Sequence(rid=req.rid, tokens=list(req.input_ids), sampling=req.sampling,
                       eos_ids=frozenset(req.eos_token_ids), namespace=req.namespace,
                       output_subject=req.output_subject, checkpoint_at=list(req.checkpoint_at),
                       priority=req.priority, quota_pages=req.quota_pages, pin=req.pin, pin_ttl_s=req.pin_ttl_s,
                       logprob_start=req.logprob_start,
                       after=req.after, quiet=req.quiet, transfer_to=req.transfer_to,
                       transfer_from=req.transfer_from // self.page_size * self.page_size)
        if req.transfer_to and self.spec.is_hybrid and (b := (seq.prompt_len - 1) // self.page_size * self.page_size):
            seq.checkpoint_at.append(b)       # the state where the moved pages end goes with them
        if grammar is not None:
            seq.matcher = grammar.matcher()
        with self._lock:
            if req.rid in self._live or any(s.rid == req.rid for s in self._new):
                raise BadRequest(f"request id {req.rid!r} is already running", param="rid")
            self._new.append(seq)
            self._last_arrival = seq.arrived = time.monotonic()
            self._expect = max(self._expect - 1, req.burst)
        if self.tiers is not None:
            self.tiers.prefetch(seq)        # its pages on disk come up to host memory while it waits

    def abort(self, rids: list[str], discard: bool = False) -> None:
        """Stop requests; with discard (a cancelled program branch) nothing more of them is cached."""
        with self._lock:
            self._aborts.update(rids)
            if discard:
                self._discards.update(rids)

    def hint(self, h: CacheHints) -> None:
        """Programs' cache hints (unpin, demote): passed to radix with the next step's exchange."""
        with self._lock:
            self._hints.append(h)

    def has_work(self) -> bool:
        with self._lock:
            busy = bool(self._new or self._aborts or self._hints or self._sync or self.batcher.has_work())
        # what the tiers gained and lost goes to radix even when no request runs (placement reads it),
        # but not while radix is down: the heartbeat's sync() wakes the loop when it is back
        return busy or self.tiers is not None and not self._radix_down_since and self.tiers.pending()

    def sync(self) -> None:
        """Exchange with radix at the next step even with nothing to say: a new radix instance
        learns of this pool now (NotFound, then _rejoin), not at its next request."""
        with self._lock:
            self._sync = True

    @property
    def num_running(self) -> int:
        return len(self.batcher.running)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher.waiting) + len(self._new)

    def stats(self) -> dict[str, int]:
        return dict(self.counters) | {"running": self.num_running, "waiting": self.num_waiting, "steps": self.steps,
                                      "preempted_total": self.preempted,
                                      "jump_forward_drafted_total": self.runner.drafted,
                                      "jump_forward_kept_total": self.runner.kept,
                                      "jump_forward_certain_total": self.runner.certain} \
            | (self.tiers.stats() if self.tiers else {})

    # ------------------------------------------------------------ the loop (compute thread)

    def _await_burst(self) -> None:
        with self._lock:
            if not self._new:
                return
            enough = self.cfg.burst_enough_tokens
            if enough > 0 and sum(s.prompt_len for s in self._new) >= enough:
                return
        deadline = time.monotonic() + self.cfg.burst_wait_s
        # announced requests are waited for only while nothing runs: running requests' decode steps
        # do not stall for them
        idle = not self.batcher.running
        while time.monotonic() < deadline and (time.monotonic() - self._last_arrival < self.cfg.burst_gap_s
                                               or idle and self._expect > 0):
            time.sleep(max(self.cfg.burst_gap_s / 4, 0.0005))
        self._expect = 0         # what was announced and did not come is not waited for again

    def step(self) -> list[tuple[str, SeqOutput]]:
        """One step; returns (output subject, output) for every sequence that advanced or ended."""
        self.last_compute_s, self.last_tokens = 0.0, 0
        self._await_burst()
        outs = self._intake()
        if self.cfg.decode_reserve > 0:
            # a page ahead (and any draft's length): with overlap the answer comes a step later
            self.batcher.ask_growth(self.page_size, self.page_size + self.cfg.jump_forward + 1)
        # Overlap, except right after a prefill step that computed what deferred candidates wait
        # for (an agent's siblings wait for the first one's preamble): its progress reaches radix
        # with this exchange, and overlapped, the siblings' grants would join only the step after
        # this one, which would decode the first request alone (a whole step). Waiting for the
        # answer instead costs one round trip, once per such prefill.
        wait = self._shared_wait and bool(self.batcher.progress)
        self._shared_wait = False      # once: an exchange that fails (radix down) does not renew it
        if self.cfg.overlap and self.batcher.running and not wait:
            pending = self._send()
            self.overlapped += pending is not None
            outs += self._compute()
            return outs + (self._receive(*pending) if pending else [])
        outs += self._exchange()
        for _ in range(3):
            # requests that arrived while we waited on the page authority join this step rather than
            # the next: a burst of requests is prefilled together (no added wait for a lone request)
            with self._lock:
                if not self._new:
                    break
            took = self._intake()
            outs += took
            if self.cache and not took and self.batcher.waiting_follow(self.page_size):
                # an agent's siblings behind its first request: they would wait for the page it
                # computes now anyway; they go with the exchange after this step, which waits for
                # its answer as after a "shared-prefix" deferral (an intake that ended requests has
                # releases to send: it goes now). Hybrid models too: radix plans checkpoints only at
                # admission, so asking now would add none where they part (waiting_follow says
                # which rare sibling this delays by a step)
                self._shared_wait = True
                break
            outs += self._exchange()
        return outs + self._compute()

    def _compute(self) -> list[tuple[str, SeqOutput]]:
        outs = []
        self._make_room()
        plan = self.batcher.schedule()
        if plan is None:
            return outs
        t0 = time.perf_counter()
        try:
            toks = self.runner.run(plan)
        except Exception as e:
            # A bug, or an input that breaks the step: the step's sequences fail, each with an error,
            # and the engine goes on. Raising instead would retry the same plan forever. Nothing of
            # the step is kept: computed_len did not advance, so no KV or state of it is cached.
            _log.error("step failed", error=repr(e), requests=len(plan.seqs), exc_info=e)
            return outs + [self._error(s, 500, f"internal error in a model step: {type(e).__name__}: {e}")
                           for s in plan.seqs]
        self.steps += 1
        self.mixed_steps += plan.mixed
        outs += self._postprocess(plan, toks)
        self.last_compute_s = time.perf_counter() - t0
        self.last_tokens = sum(plan.extend_lens)
        self.step_seconds["decode" if plan.is_decode else "prefill"].observe(self.last_compute_s)
        return outs

    def _intake(self) -> list[tuple[str, SeqOutput]]:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, set()
            discards, self._discards = self._discards, set()
            hints, self._hints = self._hints, []
            imports, self._imports = self._imports, []
            for s in new:
                self._live[s.rid] = s
        for namespace, tokens, first, k, v, state in imports:     # before the requests that will load them
            self.tiers.put(namespace, tokens, first, k, v, state)
        for s in new:
            if self.tiers is not None and (at := self.tiers.known_boundary(s)) and at not in s.checkpoint_at:
                s.checkpoint_at.append(at)
            self.batcher.add(s)
        for h in hints:
            self.batcher.unpins += h.unpins
            self.batcher.demotes += h.demotes
        outs = []
        for rid in aborts:
            seq = self._live.get(rid)
            if seq is not None:
                seq.discard = rid in discards
                seq.finish("abort")
                outs.append(self._finish(seq, seq.output_ids[seq.reported:]))
        return outs

    def _postprocess(self, plan: Plan, toks: dict[int, list[int]]) -> list[tuple[str, SeqOutput]]:
        outs = []
        state = self.runner.state
        ps = self.page_size
        drafting, copies = [], []
        tapped: list[tuple[Sequence, int, int]] = []     # (sequence, state slot, position) checkpointed now
        befores = [s.computed_len for s in plan.seqs]
        for i, (seq, ext) in enumerate(zip(plan.seqs, plan.extend_lens)):
            new = toks.get(i, [])
            before = seq.computed_len
            decoding = before >= seq.prefill_len      # a decode step's row, or a decode row of a mixed step
            if plan.is_decode:
                ext = max(len(new), 1)    # the pending token, and each kept draft token, were computed
            seq.computed_len += ext
            if state is not None:
                # the working state now summarizes exactly computed_len tokens: copy it out where planned
                slot = seq.checkpoints.get(seq.computed_len)
                if slot is not None:
                    copies.append((seq.state_slot, slot))
                    tapped.append((seq, slot, seq.computed_len))
                elif decoding and seq.tail_slot >= 0 and seq.computed_len // ps > before // ps:
                    boundary = seq.computed_len // ps * ps
                    if boundary == seq.computed_len:
                        copies.append((seq.state_slot, seq.tail_slot))
                    else:   # crossed inside a step with a draft: the state as it was at the boundary
                        self.runner.state_after(seq.rid, boundary - before - 1, seq.tail_slot)
                    seq.tail_pos = boundary
                    tapped.append((seq, seq.tail_slot, boundary))
                # checkpoints inside the chunk, copied out by the model (ForwardBatch.taps)
                tapped += [(seq, x, q) for q, x in seq.checkpoints.items() if before < q < seq.computed_len]
            if not decoding:
                self.counters["prefill_tokens_computed_total"] += ext
                if self.cache and seq.computed_len <= seq.prefill_len:
                    self.batcher.progress.append(Progress(rid=seq.rid, computed=seq.computed_len, unfilled=seq.unfilled))
                    seq.unfilled = []
                if seq.prefill_only and seq.computed_len == seq.prompt_len:
                    seq.finish("length")
                    outs.append(self._finish(seq, []))
                    continue
            if not new:
                continue
            failed = False
            for n, t in enumerate(new, 1):
                seq.tokens.append(t)
                self.counters["generated_tokens_total"] += 1
                if seq.matcher is not None and not seq.matcher.accept_token(t):
                    outs.append(self._error(seq, 500, f"sampled token {t} is outside the grammar"))
                    failed = True
                    break
                if seq.matcher is not None and seq.matcher.is_terminated():
                    seq.finish("stop", t)              # the grammar is complete (it ended on a stop token)
                elif t in seq.stop_ids:
                    seq.finish("stop", t)
                elif seq.num_output >= seq.sampling.max_new_tokens or len(seq.tokens) >= self.max_model_len:
                    seq.finish("length")
                if seq.status == Status.FINISHED:
                    if n < len(new):     # ended inside a kept draft: what follows is not output
                        new, seq.computed_len = new[:n], len(seq.tokens) - 1
                    break
            if failed:
                continue
            seq.check(self.max_model_len)
            if seq.status == Status.FINISHED:
                outs.append(self._finish(seq, seq.output_ids[seq.reported:]))
                continue
            if self.drafter is not None and seq.matcher is not None and not has_penalties(seq.sampling):
                # penalized rows are left out: a row's penalties would have to count the draft before it
                seq.draft = self.drafter.draft(seq)
                if seq.draft:
                    drafting.append(seq)
            if not (seq.quiet and seq.reported):
                # a quiet request's tokens after its first wait for its end (_finish sends every
                # token not reported): a message per token per request is most of what the
                # service path costs a non-streamed batch
                outs.append(self._output(seq, new))
        if copies:
            state.copy_many(copies)
        if self.tiers is not None:
            # what the device now holds, by key: saved to the host tier when a grant reuses it
            for seq, before in zip(plan.seqs, befores):
                if seq.computed_len > before and seq.status != Status.FINISHED:    # _finish keyed the others
                    self.tiers.computed(seq, before)
            for seq, slot, pos in tapped:
                self.tiers.checkpointed(seq, slot, pos)
        if drafting:
            self.runner.mark_certain(drafting)
            if not self._uncertain_pays():
                for seq in drafting:
                    del seq.draft[seq.certain:]
        return outs

    # auto: a draft token that is not certain is checked against a sample, and kept only if they
    # agree (a trained model mostly spells forced text as its tokenizer does; the random-weight
    # test checkpoints about half the time). Its row is sampled over the tokens its mask allows,
    # skipping the LM head, so on the CPU it costs about (1 - the head's share) of a full row, and
    # pays when kept more often than that (the bigger the vocabulary, the more often it pays). On
    # an accelerator a decode step's rows are nearly free. The keep
    # rate is measured as the engine runs; while it does not pay, one step in AUTO_PROBE still
    # drafts them, so that the estimate follows the workload.
    AUTO_PROBE = 16

    def _uncertain_pays(self) -> bool:
        policy = self.cfg.jump_forward_policy
        if policy != "auto":
            return policy == "all"
        if self._row_cost is None:
            self._row_cost = 1.0 - self.runner.head_share() if self.runner.device.type == "cpu" else 0.0
        drafted, kept = self.runner.unsure
        return (kept + 1) / (drafted + 2) > self._row_cost or self.steps % self.AUTO_PROBE == 0

    def _output(self, seq: Sequence, new: list[int]) -> tuple[str, SeqOutput]:
        # `new` is always output_ids[reported:reported + len(new)]: the logprobs of the same tokens
        start, seq.reported = seq.reported, seq.reported + len(new)
        return seq.output_subject, SeqOutput(rid=seq.rid, token_ids=new, offset=start, prompt_tokens=seq.prompt_len,
                                             cached_tokens=min(seq.cached_len + seq.loaded_len, seq.prompt_len),
                                             logprobs=seq.logprobs[start:seq.reported],
                                             top_logprobs=seq.top_logprobs[start:seq.reported])

    def _finish(self, seq: Sequence, new: list[int]) -> tuple[str, SeqOutput]:
        if self.tiers is not None and seq.pages:
            self.tiers.computed(seq, 0)        # its pages, before the release gives them back
        if seq.transfer_to and seq.finish_reason == "length":
            # its pages are read now, before their release lets radix grant them again; the service
            # sends them and reports the end once they are stored there
            pages = (seq.prompt_len - 1) // self.page_size
            first = min(seq.transfer_from // self.page_size, pages)
            export = (seq.transfer_to, seq.namespace, seq.tokens[:pages * self.page_size], first,
                      *export_pages(self.runner.kv, self.runner.state, seq, pages, first))
            with self._lock:
                self.exports[seq.rid] = export
        self.batcher.finish(seq)
        subject, out = self._output(seq, new)
        with self._lock:
            self._live.pop(seq.rid, None)
            # what it reported, for a replay if an output is lost on the way (service.replay)
            self.finished_outputs[seq.rid] = (seq.output_ids[:seq.reported], seq.logprobs[:seq.reported],
                                              seq.top_logprobs[:seq.reported])
            while len(self.finished_outputs) > FINISHED_KEEP:
                self.finished_outputs.popitem(last=False)
        out.finished, out.finish_reason, out.matched_stop = True, seq.finish_reason, seq.matched_stop
        out.input_logprobs, out.input_top_logprobs = seq.input_logprobs, seq.input_top_logprobs
        return subject, out

    def take_export(self, rid: str) -> tuple | None:
        with self._lock:
            return self.exports.pop(rid, None)

    def import_pages(self, msg: KVPages) -> tuple[int, int]:
        """Another executor's pages (KVPages) for the host tier, checked here (a clear error for a
        sender that disagrees on the model or the layout) and stored by the compute thread before
        it admits anything else. Returns (pages, bytes) taken."""
        if self.tiers is None:
            raise BadRequest("this executor has no host tier to take pages into (start it with --kv-host-pages)")
        k, v, state = unpack(msg, self.tiers, self.runner.kv.k[0].dtype, self.page_size)
        with self._lock:
            self._imports.append((msg.namespace, list(msg.tokens), msg.first, k, v, state))
        return msg.count, len(msg.data) + len(msg.state)

    def _error(self, seq: Sequence, code: int, message: str) -> tuple[str, SeqOutput]:
        seq.finish("error")
        subject, out = self._finish(seq, [])
        out.error, out.error_code = message, code
        return subject, out
