"""Jump-forward decoding: when the grammar forces the next characters (the rest of a key, `":`,
an enum's tail), their tokens go into the next step as a draft instead of costing a decode step
each. The step computes the pending token and the draft together, one row per position, and
samples every row under its own grammar mask; the draft is kept up to its first token that
differs from what was sampled at that position (verify.py: _verify):

    pending t0, draft d1 d2 d3  --one step-->  x0 x1 x2 x3 sampled (x_i masked as after d1..d_i)
    output: x0, and x1 if x0 == d1, and x2 if also x1 == d2, ...   (at least one token, at most 4)

So the output is exactly the one decoding without drafts gives: for greedy requests token for
token (test_jump_forward), for sampled ones in distribution (each kept token was drawn from the
same conditional). SGLang instead appends the forced text's tokens as they are, which changes the
output whenever the model would have split the text differently.

The draft is the forced text as the model's tokenizer writes it (spelling.py), only the part the
grammar accepts, and never more than the request may still generate.
"""
from __future__ import annotations

from .sequence import Sequence
from .spelling import Speller


class Drafter:
    def __init__(self, speller: Speller, max_draft: int = 8):
        self.speller = speller
        self.max_draft = max_draft

    def draft(self, seq: Sequence) -> list[int]:
        """The next step's draft for `seq` (whose matcher has accepted its pending token)."""
        room = min(self.max_draft, seq.sampling.max_new_tokens - seq.num_output - 1)
        if room <= 0 or seq.matcher is None:
            return []
        text = seq.matcher.forced_text()
        if not text:
            return []
        ids = self.speller.spell(seq.tokens[-1], text)[:room]
        return ids[:seq.matcher.legal_prefix(ids)]
