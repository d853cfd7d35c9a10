"""The tokenizer state of each grammar engine for a served model (xgrammar's TokenizerInfo,
llguidance's LLTokenizer), built the same way by the grammar workers (to compile) and by every
executor (to load the compiled blobs and mask logits).

Why not plain `TokenizerInfo.from_huggingface`: xgrammar treats a token as "special" (never
allowed by any grammar) only when its text is empty; it keeps `<|im_start|>` as the literal
12-character string. A JSON string, a `.*` regex or an EBNF `[^a]*` would then accept the single
chat-control token `<|im_start|>`, which the detokenizer drops (skip_special_tokens), so the
caller would get text that differs from what the grammar checked, and the model could open a new
chat turn inside "constrained" output. So we let from_huggingface detect the vocabulary encoding
(byte-level / byte-fallback / raw, prefix space), then rebuild the info from the same vocabulary
with every special token blanked. Stop ids stay stop ids: xgrammar allows them exactly where the
grammar can end, whatever their text.

Deterministic (the vocabulary, config.json and generation_config.json decide everything) and cheap
(tens of ms for an 8k vocabulary, about a second for a 150k one), so each process builds it once.

llguidance needs no such rebuild: it reads the tokenizer.json itself, and tokens marked special
there never match grammar text (a JSON string cannot produce `<|im_start|>`); its stop tokens are
the same eos ids. Both take the model's vocabulary size, so their masks have the logits' width and
ids past the tokenizer's (padding) are never allowed.
"""
from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.hf
import xgrammar as xgr

from radixflow.services.tokenizer.tokenizer import Tokenizer

# Bumped whenever the construction below changes what a grammar may produce; part of the identity,
# so blobs compiled under an older rule are never served to executors using the new one.
SPECIAL_POLICY = "nospecial1"


def model_vocab_size(model_dir: str | Path, tok: Tokenizer | None = None) -> int:
    """The model's (possibly padded) vocabulary: the width of its logits, hence of the token mask."""
    cfg_path = Path(model_dir) / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        # multimodal configs keep the language model's settings in text_config
        for section in (cfg, cfg.get("text_config") or {}):
            if isinstance(section.get("vocab_size"), int):
                return section["vocab_size"]
    return (tok or Tokenizer(model_dir)).vocab_size


def make_tokenizer_info(model_dir: str | Path) -> xgr.TokenizerInfo:
    tok = Tokenizer(model_dir)
    vocab_size = model_vocab_size(model_dir, tok)
    stop_ids = sorted(tok.eos_token_ids)
    detected = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
    # Same vocabulary list from_huggingface builds for every backend (index = id, "" for holes and
    # padding), minus the special tokens.
    encoded = [""] * vocab_size
    for text, idx in tok.hf.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = text
    for idx in tok.special_ids:
        if idx < vocab_size:
            encoded[idx] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids,
                             add_prefix_space=detected.add_prefix_space)


def make_ll_tokenizer(model_dir: str | Path) -> llguidance.LLTokenizer:
    tok = Tokenizer(model_dir)
    return llguidance.hf.from_tokenizer(tok.hf, n_vocab=model_vocab_size(model_dir, tok),
                                        eos_token=sorted(tok.eos_token_ids))


def tokenizer_identity(model_dir: str | Path) -> str:
    """What a compiled grammar depends on: the text<->id mapping, the mask width, the special-token rule."""
    tok = Tokenizer(model_dir)
    return f"{tok.identity}-v{model_vocab_size(model_dir, tok)}-{SPECIAL_POLICY}"
