"""Structured output in the executor: grammar masks applied to a step's logits before sampling.

    logits [M, V] --(bitmask of the constrained rows, filled together)--> -inf where illegal
    sample --> matcher.accept_token --> finished when the grammar terminates

One GrammarMatcher per constrained request (made from the compiled grammar the request names);
unconstrained rows of a mixed batch are left alone. The bitmask buffer is allocated once.
"""
from __future__ import annotations

import torch
import xgrammar as xgr


class Constrainer:
    def __init__(self, vocab_size: int, max_rows: int):
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)     # int32 [M, ceil(V / 32)]
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")

    def mask(self, logits: torch.Tensor, matchers: list["xgr.GrammarMatcher | None"]) -> None:
        """Mask, in place, the rows of `logits` whose matcher is given."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        if logits.shape[0] > self.bitmask.shape[0]:
            self.bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        self.batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], self.bitmask, indices=rows)
        cpu = logits if logits.device.type == "cpu" else logits.cpu()
        xgr.apply_token_bitmask_inplace(cpu, self.bitmask[: logits.shape[0]].to(cpu.device), indices=rows,
                                        vocab_size=self.vocab_size)
        if cpu is not logits:
            logits.copy_(cpu)
