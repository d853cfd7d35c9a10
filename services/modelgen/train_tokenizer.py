"""Train the byte-level BPE tokenizer shipped with the generated test models.

    python -m radixflow.services.modelgen.train_tokenizer OUT.json

The corpus is the top-level ``*.py`` modules of the running interpreter's standard library (about 4.7 MB
on CPython 3.11): it is on every machine, needs no network, and mixes code with English docstrings. The
shipped ``assets/tokenizer.json`` is the artifact of record; rerunning on a different CPython patch release
may give a slightly different merge table, which is why make-model copies the asset instead of retraining.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 8192
# Order fixes the ids (0, 1, 2): the chat template and the generation config refer to them by id.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer pattern: contractions, letter runs with one optional leading non-letter, single
# digits, punctuation runs that absorb trailing newlines, and whitespace runs that leave the last space to
# the following word. Single digits keep numbers from eating merge budget.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def iter_corpus(paths: list[Path]):
    for path in paths:
        # errors="replace" because a few stdlib modules carry latin-1 test strings; the replacement
        # character is harmless training text.
        yield path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No normalizer on purpose: NFC (as Qwen ships) would make decode(encode(s)) != s for decomposed
    # input, and exact round trips are what the detokenizer tests rely on.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(out_path: str | Path) -> Path:
    tok = build_tokenizer()
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,  # the BPE trainer counts special tokens and the 256 bytes inside this
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_corpus(corpus_files()), trainer=trainer)

    got = tok.get_vocab_size(with_added_tokens=True)
    if got != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {got} entries, expected {VOCAB_SIZE}")
    for want_id, text in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(text) != want_id:
            raise RuntimeError(f"{text} got id {tok.token_to_id(text)}, expected {want_id}")

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compact JSON keeps the shipped asset small; sort_keys is not used because the vocab order is the
    # id order that readers expect to see.
    data = json.loads(tok.to_str())
    out.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the tokenizer.json to write")
    args = parser.parse_args(argv)
    out = train(args.out)
    print(f"wrote {out} ({out.stat().st_size} bytes, vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
