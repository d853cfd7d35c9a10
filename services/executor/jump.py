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

The draft is the forced text as the model's tokenizer writes it, re-tokenized at the boundary:
the pending token's text and the forced text are encoded together, and when that encoding starts
with the pending token, the draft is the rest (so `"` + `name":` drafts the tokens the tokenizer
writes after a `"`); otherwise the forced text is encoded alone. Only the part the grammar accepts
is kept, and never more than the request may still generate.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from .sequence import Sequence


class Drafter:
    # forced texts repeat (a schema's keys, `": "`, `}, {"`): their spelling after a given token is
    # remembered instead of decoding and re-encoding it every step; the dict starts over when full
    CACHE_SIZE = 4096

    def __init__(self, model_dir: str | Path, max_draft: int = 8):
        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.max_draft = max_draft
        self.special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.spelled: dict[tuple[int, str], list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def draft(self, seq: Sequence) -> list[int]:
        """The next step's draft for `seq` (whose matcher has accepted its pending token)."""
        room = min(self.max_draft, seq.sampling.max_new_tokens - seq.num_output - 1)
        if room <= 0 or seq.matcher is None:
            return []
        text = seq.matcher.forced_text()
        if not text:
            return []
        ids = self.spell(seq.tokens[-1], text)[:room]
        return ids[:seq.matcher.legal_prefix(ids)]

    def spell(self, last: int, text: str) -> list[int]:
        """`text` as the tokenizer writes it after token `last`, up to any special token in it."""
        key = (last, text)
        ids = self.spelled.get(key)
        if ids is not None:
            return ids
        ids = []
        if last not in self.special:
            prev = self.tok.decode([last], skip_special_tokens=False)
            if prev and "\ufffd" not in prev:
                both = self.encode(prev + text)
                if both[:1] == [last]:
                    ids = both[1:]
        if not ids:
            ids = self.encode(text)
        for n, t in enumerate(ids):      # forced text spelling a special token ends the draft there
            if t in self.special:
                ids = ids[:n]
                break
        if len(self.spelled) >= self.CACHE_SIZE:
            self.spelled.clear()
        self.spelled[key] = ids
        return ids
