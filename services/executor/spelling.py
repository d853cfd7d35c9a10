"""How forced text is spelled in tokens. Where the grammar forces the next characters (a key's
`": "`, `"}, {"id": `), the model could write them with several token sequences (`":` or `"` `:`);
the tokenizer writes them one way, the way a model saw such text in training.

    Speller.spell(last, text)   the tokenizer's tokens for `text` written after token `last`
    Speller.forced(last, m)     under forced_spelling "tokenizer": the one token a matcher's
                                mask keeps next (Constrainer.fill), or None

Spelling is re-tokenized at the boundary: the previous token's text and the forced text are encoded
together, and when that encoding starts with the previous token the spelling is the rest (so after
a `"`, `name":` is spelled as the tokenizer writes it after a `"`); otherwise the forced text is
encoded alone. The last token of a spelling is never forced: what the model writes after the forced
text may merge with it (`": "` then `a` is `":` ` "a` where the tokenizer has ` "a`), so it stays the
model's choice among the grammar's tokens. With the tokenizer's spelling, each forced token is the
only one its mask allows: jump-forward (jump.py) keeps such tokens without sampling them, and
the output is the same with and without it.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class Speller:
    # forced texts repeat (a schema's keys, `": "`, `}, {"`): their spelling after a given token is
    # remembered instead of decoding and re-encoding it every step; the dict starts over when full
    CACHE_SIZE = 4096

    def __init__(self, model_dir: str | Path):
        self.tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self.spelled: dict[tuple[int, str], list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

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
        for n, t in enumerate(ids):      # forced text spelling a special token ends the spelling there
            if t in self.special:
                ids = ids[:n]
                break
        if len(self.spelled) >= self.CACHE_SIZE:
            self.spelled.clear()
        self.spelled[key] = ids
        return ids

    def forced(self, last: int, matcher) -> int | None:
        """The next token of the forced text's spelling after `last`, where it has more than one
        (the last one is left free); None where nothing is forced. Its legality is the caller's to
        check (Constrainer.fill: its bit in the grammar's own mask)."""
        text = matcher.forced_text()
        if not text:
            return None
        ids = self.spell(last, text)
        return ids[0] if len(ids) > 1 else None
