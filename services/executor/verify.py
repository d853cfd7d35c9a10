"""Jump-forward's half of the model runner (jump.py makes the drafts): a decode step with drafts
has a row per drafted position; _verify samples each row under its own mask and keeps each draft
up to its first token that differs from its sample. Certain draft tokens (the only one the grammar
allows there, mark_certain) are kept without a mask or a sample; the others are sampled over the
tokens their mask allows (_sample_allowed). A rejected tail's DeltaNet state is put back from the
states the layers kept (state_after).

A mixin of ModelRunner (runner.py), which owns the model, the pools and the constrainer.
"""
from __future__ import annotations

from typing import Callable

import torch

from radixflow.kernels.dispatch import Kernels

from . import sampler
from .constrain import Constrainer, allowed_tokens, allows, single_allowed
from .forward_batch import ForwardBatch
from .memory import KVPool, StatePool
from .models import CausalLM, ModelSpec

MAX_ALLOWED = 1024       # a draft row allowing more tokens than this gets the full head (_sample_allowed)


class DraftVerify:
    """Its contract with the host (ModelRunner): the attributes and methods annotated here."""
    model: CausalLM
    spec: ModelSpec
    kernels: Kernels
    kv: KVPool
    state: StatePool | None
    constrainer: Constrainer
    last: ForwardBatch | None
    drafted: int
    kept: int
    certain: int
    unsure: list[int]
    _keep_logprobs: Callable[..., None]      # (seq, logprob, top)

    def head_share(self) -> float:
        """The LM head's share of a row's multiply-adds (every weight but the embedding's)."""
        m = self.model
        total = sum(p.numel() for p in m.parameters()) - m.embed.weight.numel()
        return m.lm_head.weight.numel() / max(total, 1)

    def _boundary_inside(self, s) -> bool:
        """A page boundary after one of s's draft rows but its last: the engine's tail checkpoint
        is the state as it was there (engine._postprocess), so the step must keep it."""
        ps, before = self.kv.page_size, s.computed_len
        after = before + 1 + len(s.draft)
        return s.tail_slot >= 0 and after // ps > before // ps and after % ps != 0

    @torch.inference_mode()
    def _verify(self, fb: ForwardBatch, seqs: list, hidden: torch.Tensor) -> dict[int, list[int]]:
        """A decode step with drafts (hidden: every row's final hidden state): every row sampled
        under the grammar as it stands after the draft tokens before it; each sequence keeps its
        samples up to the first that differs from its draft. Where the tail of a draft is dropped,
        its recurrent state is put back to the last kept position (the rows' KV beyond it is never
        read: a later step overwrites it).

        A row that predicts a token inside the forced text (every row of a sequence but its last)
        is sampled over the few tokens its mask allows, from logits computed for those tokens only:
        at a 248k vocabulary the full head is most of a tiny model's cost per row, and a draft row
        would otherwise pay it to choose among a handful of tokens (_sample_allowed)."""
        n = hidden.shape[0]
        rows = [None] * n
        for s, rs in zip(seqs, fb.rows_of):
            for r in rs:
                rows[r] = s
        self._fill_drafts(seqs, fb.rows_of, n)
        forced = [r for s, rs in zip(seqs, fb.rows_of) if s.matcher is not None and self._plain(s.sampling)
                  for r in rs[s.certain:len(s.draft)]]
        tokens = [0] * n
        lps, tops = [None] * n, [None] * n
        done = self._sample_allowed(hidden, forced, rows, tokens) if forced else set()
        for s, rs in zip(seqs, fb.rows_of):      # the only token allowed: what sampling would give
            for d in range(s.certain):
                tokens[rs[d]] = s.draft[d]
                done.add(rs[d])
        full = [r for r in range(n) if r not in done]
        if full:
            logits = self.model.logits(hidden[torch.tensor(full, dtype=torch.int64, device=hidden.device)], self.kernels)
            masked = [j for j, r in enumerate(full) if rows[r].matcher is not None]
            mask = (lambda x: self.constrainer.apply(x, masked, [full[j] for j in masked])) if masked else None
            out = sampler.sample(logits, [rows[r] for r in full], mask=mask)
            for j, r in enumerate(full):
                tokens[r], lps[r], tops[r] = out.tokens[j], out.logprobs[j], out.top[j]
        new = {}
        for i, (s, rs) in enumerate(zip(seqs, fb.rows_of)):
            kept = []
            for d, r in enumerate(rs):
                t = tokens[r]
                kept.append(t)
                self._keep_logprobs(s, lps[r], tops[r])
                if d == len(s.draft) or t != s.draft[d]:
                    break
            if s.draft:
                self.drafted += len(s.draft)
                self.kept += len(kept) - 1
                self.certain += s.certain
                self.unsure[0] += len(s.draft) - s.certain
                self.unsure[1] += max(len(kept) - 1 - s.certain, 0)
                if len(kept) <= len(s.draft) and self.state is not None:
                    self.state_after(s.rid, len(kept) - 1, s.state_slot)
            new[i] = kept
            s.draft, s.certain = [], 0
        return new

    @staticmethod
    def _plain(p) -> bool:
        """Sampling that a row's allowed tokens alone decide: no logprobs (they are over the whole
        vocabulary), no biases or penalties (they would have to be gathered too)."""
        return not (sampler.wants_logprobs(p) or p.logit_bias or sampler.has_penalties(p))

    def _sample_allowed(self, hidden: torch.Tensor, rows: list[int], seq_of: list, tokens: list[int]) -> set[int]:
        """Sample each of `rows` over the tokens its filled bitmask row allows: their logits only
        (a gather of the head's weight rows), padded with -inf into one [R, A] batch for the
        sampler, then mapped back to token ids into `tokens`. Rows allowing more than
        MAX_ALLOWED tokens (or none) are left to the full head; returns the rows sampled here."""
        dev = hidden.device
        row, ids = allowed_tokens(self.constrainer.bitmask, rows, self.spec.vocab_size)
        counts = torch.bincount(row, minlength=len(rows))
        ok = (counts > 0) & (counts <= MAX_ALLOWED)
        if not bool(ok.any()):
            return set()
        if not bool(ok.all()):
            keep = ok[row]
            row, ids = row[keep], ids[keep]
            idx = ok.nonzero()[:, 0]
            remap = torch.cumsum(ok, 0) - 1
            row, counts = remap[row], counts[idx]
            rows = [rows[i] for i in idx.tolist()]
        start = torch.cumsum(counts, 0) - counts
        col = torch.arange(len(ids)) - start[row]
        width = int(counts.max())
        h = hidden[torch.tensor(rows, dtype=torch.int64, device=dev)]                    # [R, H]
        ids_d, row_d, col_d = ids.to(dev), row.to(dev), col.to(dev)
        vals = (self.model.lm_head.weight[ids_d] * h[row_d]).sum(-1).float()
        logits = torch.full((len(rows), width), float("-inf"), device=dev)
        logits[row_d, col_d] = vals
        table = torch.zeros((len(rows), width), dtype=torch.int64, device=dev)
        table[row_d, col_d] = ids_d
        out = sampler.sample(logits, [seq_of[r] for r in rows])
        picked = table.gather(1, torch.tensor(out.tokens, dtype=torch.int64, device=dev)[:, None])[:, 0].tolist()
        for r, t in zip(rows, picked):
            tokens[r] = t
        return set(rows)

    def mark_certain(self, seqs: list) -> None:
        """Set each drafting sequence's `certain`: how many of its draft's first tokens are the only
        token its grammar allows there (a key's closing `":` where no other spelling is legal). Such
        a token is what sampling under the mask would give, whatever the logits: the next step
        keeps it without sampling it, and can never have to undo it. The matchers walk the drafts
        depth by depth, one batched mask fill per depth, as long as every token so far is certain."""
        live = [s for s in seqs if s.draft and self._plain(s.sampling)]
        for s in seqs:
            s.certain = 0
        speller = self.constrainer.speller
        d = 0
        while live:
            # under forced_spelling "tokenizer", where the forced text's spelling has more than one
            # token the mask keeps only its next one (Constrainer.fill): a draft token the spelling
            # at its position starts with is certain without a mask (the drafter checked it is
            # legal). Only the others' masks are filled (a mask fill is a visible share of a step)
            spelled = set()
            if speller is not None:
                spelled = {id(s) for s in live if speller.forced(s.draft[d - 1] if d else s.tokens[-1], s.matcher) == s.draft[d]}
            check = [s for s in live if id(s) not in spelled]
            if check:
                self.constrainer.fill(list(range(len(check))), [s.matcher for s in check], len(check),
                                      [s.draft[d - 1] if d else s.tokens[-1] for s in check])
                if d == 0:     # the masks the next step needs first (for rows that are not certain)
                    self.constrainer.keep([s.matcher for s in check])
                single = single_allowed(self.constrainer.bitmask, len(check)).tolist()
                # the one token allowed is the draft's, unless the tokenizer spells the forced text
                # differently after a drafted token than it spelled it whole (spelling.py)
                spelled |= {id(s) for j, (s, one) in enumerate(zip(check, single))
                            if one and allows(self.constrainer.bitmask, j, s.draft[d])}
            live = [s for s in live if id(s) in spelled]
            for s in live:
                s.matcher.accept_token(s.draft[d])     # legal: the drafter checked it
                s.certain += 1
            d += 1
            live = [s for s in live if d < len(s.draft)]
        for s in seqs:
            if s.certain:
                s.matcher.rollback(s.certain)

    def _fill_drafts(self, seqs: list, rows_of: list[list[int]], num_rows: int) -> None:
        """Grammar masks for every row of a step with drafts, into the bitmask rows of the same
        index. A sequence's row at depth d gets the mask of its matcher after the first d draft
        tokens: the matchers walk the drafts depth by depth (one batched fill per depth) and are
        rolled back after."""
        con = [(s, rs) for s, rs in zip(seqs, rows_of) if s.matcher is not None]
        live, d = con, 0
        while live:
            unsure = [(s, rs) for s, rs in live if d >= s.certain]      # a certain row is not sampled
            if unsure:      # depth 0: the matchers are as mark_certain left them (reuse)
                self.constrainer.fill([rs[d] for _, rs in unsure], [s.matcher for s, _ in unsure], num_rows,
                                      [s.draft[d - 1] if d else s.tokens[-1] for s, _ in unsure], reuse=d == 0)
            live = [(s, rs) for s, rs in live if d < len(s.draft)]
            for s, _ in live:
                s.matcher.accept_token(s.draft[d])      # legal: the drafter checked it
            d += 1
        for s, _ in con:
            s.matcher.rollback(len(s.draft))

    def state_after(self, rid: str, depth: int, slot: int) -> None:
        """Hybrid models: copy into `slot` the DeltaNet state (every layer's) of sequence `rid` as it
        was after its row at `depth` in the last decode step with drafts, below its last depth
        (the layers keep those: ForwardBatch.saved)."""
        j = self.last.order_pos[rid]
        for layer, (convs, recs) in enumerate(self.last.saved):
            self.state.conv[layer][slot].copy_(convs[depth][j])
            self.state.recurrent[layer][slot].copy_(recs[depth][j])
