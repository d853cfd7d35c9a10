"""Engine: the executor's core loop as a plain class. A step reads as three verbs:

    plan = batcher.schedule()      which sequences run
    toks = runner.run(plan)        compute and sample
    outs = self._postprocess(...)  append tokens, finish sequences, free their memory

`add` and `abort` may be called from another thread (the service's event loop) while `step` runs in
the compute thread; they are queued and applied at the start of the next step.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import ExecRequest, SeqOutput

from .allocator import FreeList, pages_for
from .batcher import Batcher, Plan
from .runner import ModelRunner
from .sequence import Sequence, Status


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"
    page_size: int = 16
    max_total_tokens: int = 0        # 0: auto
    max_model_len: int = 0           # 0: the model's max_position_embeddings
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192


class Engine:
    def __init__(self, cfg: EngineConfig):
        from .models import ModelSpec
        spec = ModelSpec.from_dir(cfg.model)
        self.max_model_len = min(cfg.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
        total = cfg.max_total_tokens or max(131072, 2 * self.max_model_len)
        num_pages = pages_for(total, cfg.page_size)
        num_slots = cfg.max_running_requests + 1
        self.runner = ModelRunner(cfg.model, device=cfg.device, page_size=cfg.page_size,
                                  num_pages=num_pages, num_state_slots=num_slots)
        self.spec = self.runner.spec
        self.batcher = Batcher(page_size=cfg.page_size, pages=FreeList(num_pages),
                               state_slots=FreeList(num_slots) if self.spec.is_hybrid else None,
                               max_running=cfg.max_running_requests, max_prefill_tokens=cfg.max_prefill_tokens)
        self._lock = threading.Lock()
        self._new: list[Sequence] = []
        self._aborts: set[str] = set()
        self._live: dict[str, Sequence] = {}
        self.steps = 0

    # ------------------------------------------------------------ intake (any thread)

    def validate(self, req: ExecRequest) -> None:
        n = len(req.input_ids)
        if n == 0:
            raise BadRequest("the prompt is empty", param="input_ids")
        bad = [t for t in req.input_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})", param="input_ids")
        if n + req.sampling.max_new_tokens > self.max_model_len:
            raise BadRequest(f"prompt ({n} tokens) plus max_new_tokens ({req.sampling.max_new_tokens}) exceeds the "
                             f"context length of {self.max_model_len} tokens", param="max_new_tokens")
        if pages_for(n + req.sampling.max_new_tokens, self.batcher.page_size) > self.batcher.pages.total:
            raise BadRequest(f"request needs {n + req.sampling.max_new_tokens} tokens of KV; the pool holds "
                             f"{self.batcher.pages.total * self.batcher.page_size}", param="max_new_tokens")

    def add(self, req: ExecRequest) -> None:
        self.validate(req)
        seq = Sequence(rid=req.rid, tokens=list(req.input_ids), sampling=req.sampling,
                       eos_ids=frozenset(req.eos_token_ids), namespace=req.namespace,
                       output_subject=req.output_subject)
        with self._lock:
            if req.rid in self._live or any(s.rid == req.rid for s in self._new):
                raise BadRequest(f"request id {req.rid!r} is already running", param="rid")
            self._new.append(seq)

    def abort(self, rids: list[str]) -> None:
        with self._lock:
            self._aborts.update(rids)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._new or self._aborts or self.batcher.has_work())

    @property
    def live_rids(self) -> list[str]:
        with self._lock:
            return list(self._live) + [s.rid for s in self._new]

    @property
    def num_running(self) -> int:
        return len(self.batcher.running)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher.waiting) + len(self._new)

    # ------------------------------------------------------------ the loop (compute thread)

    def step(self) -> list[tuple[str, SeqOutput]]:
        """One step; returns (output subject, output) for every sequence that advanced or ended."""
        outs = self._intake()
        plan = self.batcher.schedule()
        if plan is None:
            return outs
        toks = self.runner.run(plan)
        self.steps += 1
        return outs + self._postprocess(plan, toks)

    def _intake(self) -> list[tuple[str, SeqOutput]]:
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, set()
            for s in new:
                self._live[s.rid] = s
        for s in new:
            self.batcher.add(s)
        outs = []
        for rid in aborts:
            seq = self._live.get(rid)
            if seq is not None:
                seq.finish("abort")
                outs.append(self._finish(seq, []))
        return outs

    def _postprocess(self, plan: Plan, toks: dict[int, int]) -> list[tuple[str, SeqOutput]]:
        outs = []
        for i, (seq, ext) in enumerate(zip(plan.seqs, plan.extend_lens)):
            seq.computed_len += ext
            if i not in toks:
                continue
            t = toks[i]
            seq.tokens.append(t)
            if t in seq.stop_ids:
                seq.finish("stop", t)
            elif seq.num_output >= seq.sampling.max_new_tokens or len(seq.tokens) >= self.max_model_len:
                seq.finish("length")
            seq.check(self.max_model_len)
            if seq.status == Status.FINISHED:
                outs.append(self._finish(seq, seq.output_ids[seq.reported:]))
            else:
                outs.append(self._output(seq, [t]))
        return outs

    def _output(self, seq: Sequence, new: list[int]) -> tuple[str, SeqOutput]:
        seq.reported += len(new)
        return seq.output_subject, SeqOutput(rid=seq.rid, token_ids=new, prompt_tokens=seq.prompt_len,
                                             cached_tokens=seq.cached_len)

    def _finish(self, seq: Sequence, new: list[int]) -> tuple[str, SeqOutput]:
        self.batcher.release(seq)
        with self._lock:
            self._live.pop(seq.rid, None)
        subject, out = self._output(seq, new)
        out.finished, out.finish_reason, out.matched_stop = True, seq.finish_reason, seq.matched_stop
        return subject, out
