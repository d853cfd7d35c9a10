"""Batcher: which sequences run in the next step (continuous batching). No torch here.

A step is either a prefill of newly admitted sequences (under a token budget) or a decode of every
running sequence. A sequence is admitted only when all the pages it can ever need (prompt plus
max_new_tokens) and a state slot are granted, so decode never runs out of memory mid-flight.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .allocator import FreeList, pages_for
from .sequence import Sequence, Status


@dataclass
class Plan:
    is_decode: bool
    seqs: list[Sequence]
    extend_lens: list[int]


class Batcher:
    def __init__(self, *, page_size: int, pages: FreeList, state_slots: FreeList | None,
                 max_running: int, max_prefill_tokens: int):
        self.page_size = page_size
        self.pages = pages
        self.state_slots = state_slots
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def fits_ever(self, seq: Sequence) -> bool:
        return pages_for(seq.max_len, self.page_size) <= self.pages.total

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan | None:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            seq = self.waiting[0]
            extend = len(seq.tokens) - seq.computed_len
            if admitted and extend > budget:
                break
            if not self._grant(seq):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            admitted.append(seq)
            budget -= extend
        if admitted:
            self.running.extend(admitted)
            return Plan(False, admitted, [len(s.tokens) - s.computed_len for s in admitted])
        if self.running:
            return Plan(True, list(self.running), [1] * len(self.running))
        return None

    def _grant(self, seq: Sequence) -> bool:
        need = pages_for(seq.max_len, self.page_size) - len(seq.pages)
        if need > self.pages.num_free:
            return False
        if self.state_slots is not None and seq.state_slot < 0:
            slot = self.state_slots.alloc(1)
            if slot is None:
                return False
            seq.state_slot = slot[0]
        seq.pages += self.pages.alloc(need) or []
        return True

    def release(self, seq: Sequence) -> None:
        """Return a finished or aborted sequence's memory."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.free(seq.pages)
        seq.pages = []
        if self.state_slots is not None and seq.state_slot >= 0:
            self.state_slots.free([seq.state_slot])
            seq.state_slot = -1
