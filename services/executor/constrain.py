"""Structured output in the executor: grammar masks applied to a step's logits before sampling.

    logits [M, V] --(bitmask: each engine fills its rows)--> -inf where illegal (one apply, all rows)
    sample --> matcher.accept_token --> finished when the grammar terminates

One Matcher per constrained request (made from the compiled grammar the request names, by the
engine that compiled it: services/grammar/backends); xgrammar and llguidance rows of one batch
share the bitmask, since both write the same layout. Unconstrained rows are left alone. The
bitmask buffer is allocated once. With a speller (forced_spelling "tokenizer", spelling.py), a row
whose grammar forces text keeps only the next token of the tokenizer's spelling of it.
"""
from __future__ import annotations

import torch
import xgrammar as xgr

from radixflow.kernels.bitmask import reference as bitmask_ref
from radixflow.kernels.bitmask.reference import BITS as _BITS
from radixflow.services.grammar.backends.base import Backend, Matcher

from .spelling import Speller


class Constrainer:
    def __init__(self, vocab_size: int, max_rows: int, speller: Speller | None = None, kernels=None):
        """kernels: the runner's (dispatch.Kernels), whose apply_bitmask masks CPU logits; else the
        torch form (kernels/bitmask/reference.py)."""
        self.vocab_size = vocab_size
        self.speller = speller
        self._apply_cpu = kernels.apply_bitmask if kernels is not None else bitmask_ref.apply_bitmask
        self.bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)     # int32 [M, ceil(V / 32)]
        # rows filled by jump-forward's mark_certain, for matchers whose state the next step's first
        # fill finds unchanged (the engine accepts tokens only after that fill): that fill copies
        # them instead of asking the grammar again (keep, fill(reuse=True))
        self.kept: tuple[torch.Tensor, dict[int, tuple[Matcher, int]]] | None = None

    def mask(self, logits: torch.Tensor, matchers: list[Matcher | None], lasts: list[int]) -> None:
        """Mask, in place, the rows of `logits` whose matcher is given (lasts: each row's last token)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        self.fill(rows, [matchers[i] for i in rows], logits.shape[0], [lasts[i] for i in rows], reuse=True)
        self.apply(logits, rows)

    def keep(self, matchers: list[Matcher]) -> None:
        """Remember bitmask rows 0..len(matchers)-1, just filled for `matchers` in their current
        state, for the next fill(reuse=True); any other fill forgets them."""
        n = len(matchers)
        self.kept = (self.bitmask[:n].clone(), {id(m): (m, j) for j, m in enumerate(matchers)})

    def fill(self, rows: list[int], matchers: list[Matcher], num_rows: int, lasts: list[int],
             reuse: bool = False) -> None:
        """Write the allowed tokens of matchers[j] (in its current state, after token lasts[j]) into
        bitmask row rows[j]. reuse: the matchers' states are those of the last keep() (for the ones
        it named)."""
        if num_rows > self.bitmask.shape[0]:
            grown = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
            grown[: self.bitmask.shape[0]] = self.bitmask
            self.bitmask = grown
        kept, self.kept = self.kept, None
        by_engine: dict[Backend, tuple[list[Matcher], list[int]]] = {}
        to, frm, spelled = [], [], []
        for r, m, last in zip(rows, matchers, lasts):
            if reuse and kept is not None:
                mj = kept[1].get(id(m))
                if mj is not None and mj[0] is m:
                    to.append(r)
                    frm.append(mj[1])
                    continue
            ms, rs = by_engine.setdefault(m.backend, ([], []))
            ms.append(m)
            rs.append(r)
            if self.speller is not None:
                t = self.speller.forced(last, m)
                if t is not None:
                    spelled.append((r, t))
        if to:
            self.bitmask[torch.tensor(to, dtype=torch.int64)] = kept[0][torch.tensor(frm, dtype=torch.int64)]
        for engine, (ms, rs) in by_engine.items():
            engine.fill(ms, self.bitmask, rs)
        for r, t in spelled:
            if allows(self.bitmask, r, t):    # the grammar's own mask has the final say
                only(self.bitmask, r, t)

    def apply(self, logits: torch.Tensor, rows: list[int], mask_rows: list[int] | None = None) -> None:
        """-inf, in place, where the filled bitmask rows `rows` (or, for logits row rows[j], bitmask
        row mask_rows[j]) forbid a token."""
        if logits.device.type == "cpu":
            self._apply_cpu(logits, self.bitmask, rows, mask_rows)
        else:
            apply_bitmask_device(logits, self.bitmask, rows, mask_rows)


def allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def only(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Bitmask row `row` allows `token` alone."""
    bitmask[row].zero_()
    bit = 1 << (token & 31)
    bitmask[row, token >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit      # int32: bit 31 is the sign


def single_allowed(bitmask: torch.Tensor, rows: int) -> torch.Tensor:
    """Whether each of the first `rows` bitmask rows allows exactly one token: [rows] bool. Such a
    row has one nonzero word (so the row's sum is that word), a power of two (bit 31 included:
    its w - 1 wraps around to 2^31 - 1, which shares no bit with it)."""
    bm = bitmask[:rows]
    w = bm.sum(-1, dtype=torch.int32)
    return ((bm != 0).sum(-1) == 1) & ((w & (w - 1)) == 0)


def apply_bitmask_device(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                         mask_rows: list[int] | None = None, backend: str = "auto") -> None:
    """kernels/bitmask's apply_bitmask for logits on an accelerator: the filled bitmask rows (on the
    CPU, where the matchers write them) travel to the device, ceil(V / 32) words a row, and
    xgrammar's kernel masks the logits in place there; the logits, 32x larger, never leave the device.
    `backend`: xgrammar's (auto: its CUDA kernel on CUDA)."""
    import xgrammar as xgr
    bm = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)     # -1: every token allowed
    bm[torch.tensor(rows, dtype=torch.int64)] = bitmask[torch.tensor(mask_rows or rows, dtype=torch.int64)]
    if logits.device.type == "cuda":
        bm = bm.pin_memory()
    xgr.apply_token_bitmask_inplace(logits, bm.to(logits.device, non_blocking=True), vocab_size=logits.shape[-1],
                                    indices=rows, backend=backend)


def allowed_tokens(bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that bitmask rows `rows` allow, as (j, token id) pairs, sorted by j then id: j
    indexes `rows`. Only words with some bit set are unpacked (see kernels/bitmask/reference.py)."""
    bm = bitmask[torch.tensor(rows, dtype=torch.int64)]
    r, w = (bm != 0).nonzero(as_tuple=True)
    k, b = (((bm[r, w].unsqueeze(-1) >> _BITS) & 1) != 0).nonzero(as_tuple=True)
    row, ids = r[k], w[k].to(torch.int64) * 32 + b
    live = ids < vocab_size
    return row[live], ids[live]
