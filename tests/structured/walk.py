"""Model-free generation under a grammar: pick random allowed tokens, biased toward closing the
structure so that walks end. Used to check soundness (every finished walk must satisfy the schema)
without a model; measure_corpus.py does the same with a real (random-weight) model."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator

import torch
import xgrammar as xgr

_CLOSERS = (b'"', b"]", b"}")
_SHIFTS = torch.arange(32, dtype=torch.int32)


def bool_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Row 0 of an xgrammar bitmask (bit i%32 of int32 word i//32 = token i allowed) as bools;
    xgrammar.testing.bitmask_to_bool_mask does the same, 1000x slower."""
    return ((bitmask[0].unsqueeze(1) >> _SHIFTS) & 1).bool().flatten()[:vocab_size]


class Walker:
    def __init__(self, info: "xgr.TokenizerInfo"):
        self.vocab_size = info.vocab_size
        self.stop = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.stop[list(info.stop_token_ids)] = True
        vocab = info.decoded_vocab
        self.closer = torch.tensor([any(c in t for c in _CLOSERS) for t in vocab] +
                                   [False] * (self.vocab_size - len(vocab)))
        self.bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)

    def allowed(self, matcher: "xgr.GrammarMatcher") -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.bitmask)
        return bool_mask(self.bitmask, self.vocab_size)

    def walk(self, compiled: "xgr.CompiledGrammar", rng: random.Random, max_tokens: int = 400,
             stop_p: float = 0.5, close_p: float = 0.3) -> tuple[list[int], bool]:
        """Token ids of one walk, and whether it ended on a stop token (the grammar completed)."""
        matcher = xgr.GrammarMatcher(compiled)
        out: list[int] = []
        for _ in range(max_tokens):
            ok = self.allowed(matcher)
            can_stop = (ok & self.stop).nonzero().flatten().tolist()
            if can_stop and (rng.random() < stop_p or not (ok & ~self.stop).any()):
                tok = rng.choice(can_stop)
            else:
                pool = ok & ~self.stop
                if rng.random() < close_p and (pool & self.closer).any():
                    pool = pool & self.closer
                ids = pool.nonzero().flatten()
                tok = int(ids[rng.randrange(len(ids))])
            assert matcher.accept_token(tok), tok
            if self.stop[tok]:
                return out, True
            out.append(tok)
        return out, False

    def values(self, compiled: "xgr.CompiledGrammar", vocab: list[bytes], rng: random.Random, walks: int,
               max_tokens: int = 400) -> Iterator:
        """The JSON value of each of `walks` walks that finished. strict=False: xgrammar's own
        length-bounded strings may hold raw control characters (the compile worker patches that)."""
        for _ in range(walks):
            ids, done = self.walk(compiled, rng, max_tokens=max_tokens)
            if done:
                yield json.loads(b"".join(vocab[i] for i in ids).decode(), strict=False)
