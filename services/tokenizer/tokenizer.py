"""Tokenizer facade over a local Hugging Face tokenizer, plus stateless incremental detokenization.

Everything the serving path needs from a tokenizer lives here so that the rest of the runtime deals in
plain ``list[int]`` and ``str`` and never touches transformers objects.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        # local_files_only: a model dir that lacks a file must fail here, not quietly reach for the hub.
        self._tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True, trust_remote_code=False)
        self._eos_ids = self._collect_eos_ids()
        self._special_ids = frozenset(
            int(i) for i, tok in self._tok.added_tokens_decoder.items() if getattr(tok, "special", False)
        ) | frozenset(self._tok.all_special_ids)
        self._identity = self._compute_identity()
        self._raw = _raw_decoder(self._tok)

    # ----------------------------------------------------------------- metadata

    @property
    def hf(self) -> Any:
        """The underlying transformers tokenizer, for the few callers (grammar compilers) that need it."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included. A model's embedding table may be
        padded beyond this; logits past it must never be sampled."""
        return len(self._tok)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def identity(self) -> str:
        """16 hex chars that change whenever the text <-> id mapping can change; safe as a cache-key part."""
        return self._identity

    def _collect_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self._tok.eos_token_id is not None:
            ids.add(int(self._tok.eos_token_id))
        # Chat models often stop on several ids (end-of-turn and end-of-text) but the tokenizer names only
        # one; generation_config.json is where the rest are declared.
        gen_cfg = self.path / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(i) for i in eos)
        return frozenset(ids)

    def _compute_identity(self) -> str:
        tok_json = self.path / "tokenizer.json"
        h = hashlib.sha256()
        if tok_json.is_file():
            h.update(tok_json.read_bytes())
        else:
            # Slow-tokenizer dirs have no tokenizer.json; the vocab plus added tokens pin the mapping.
            h.update(json.dumps(self._tok.get_vocab(), sort_keys=True, ensure_ascii=False).encode("utf-8"))
        return h.hexdigest()[:16]

    # ----------------------------------------------------------------- encode / decode

    def encode(self, text: str) -> list[int]:
        """Ids for text, with no BOS/EOS added. Special-token strings inside text are still matched as
        special tokens (the Hugging Face default), so untrusted text can contain e.g. <|im_end|>."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The checkpoint's chat template over messages, by transformers' own apply_chat_template (so a
        template renders here as it does there); template_kwargs: tools, continue_final_message and
        whatever else the template reads (enable_thinking, ...)."""
        return self._tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        # Rendering then encoding (rather than tokenize=True) because transformers 5 returns a BatchEncoding
        # there, and because the template already spells out every special token it wants (BOS included:
        # no special tokens are added, as apply_chat_template(tokenize=True) adds none).
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._raw is not None:
            return self._raw.decode(ids if isinstance(ids, list) else list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- incremental detokenization

    def detokenize_incremental(
        self,
        ids: Sequence[int],
        prefix_offset: int,
        read_offset: int,
        skip_special_tokens: bool = True,
        *,
        flush: bool = False,
    ) -> tuple[str, int, int]:
        """Return (delta, new_prefix_offset, new_read_offset) for the ids generated so far.

        State is held by the caller: start a generation with prefix_offset = read_offset = 0, and after
        each call store the two returned offsets. Text up to read_offset has been emitted;
        ids[prefix_offset:read_offset] is the already-emitted context that is re-decoded so that decoders
        whose output depends on neighbouring tokens (SentencePiece's leading space) stay consistent.

        Nothing before prefix_offset is ever read, so a caller may send only the window: pass
        ids[prefix_offset:] with offsets (0, read_offset - prefix_offset), then add the old prefix_offset
        back to both returned offsets. Results are identical either way.

        A delta is held back while the undecided tail decodes to a trailing U+FFFD, i.e. a multi-byte
        UTF-8 character is split across byte-level tokens and not yet complete; the whole character is
        emitted once its last byte arrives. Pass flush=True on the final call of a generation to release
        whatever is still held (an incomplete character at the end of output, or a genuine U+FFFD). With
        that final flush, "".join(deltas) == decode(ids, skip_special_tokens) for any ids.
        """
        prefix_text = self.decode(ids[prefix_offset:read_offset], skip_special_tokens)
        new_text = self.decode(ids[prefix_offset:], skip_special_tokens)
        return _advance(prefix_text, new_text, prefix_offset, read_offset, len(ids), flush)

    def detokenize_batch(
        self,
        items: Iterable[tuple[Sequence[int], int, int]],
        skip_special_tokens: bool = True,
        *,
        flush: bool = False,
    ) -> list[tuple[str, int, int]]:
        """detokenize_incremental for many (ids, prefix_offset, read_offset) at once, with one batched
        decode call; same contract per item."""
        items = list(items)
        windows: list[list[int]] = []
        for ids, prefix_offset, read_offset in items:
            windows.append(list(ids[prefix_offset:read_offset]))
            windows.append(list(ids[prefix_offset:]))
        texts = self._tok.batch_decode(windows, skip_special_tokens=skip_special_tokens) if windows else []
        return [
            _advance(texts[2 * k], texts[2 * k + 1], p, r, len(ids), flush)
            for k, (ids, p, r) in enumerate(items)
        ]


def _raw_decoder(tok: Any) -> Any:
    """The Rust tokenizer under a transformers fast tokenizer, where decoding through it gives the
    same text: transformers' decode adds only argument handling around it (and a space cleanup, when
    configured, that this then leaves to transformers). Every streamed step decodes each request's
    window twice, and the wrapper cost more than the decode itself."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    raw = getattr(tok, "_tokenizer", None)
    if raw is None or not isinstance(tok, TokenizersBackend) or getattr(tok, "clean_up_tokenization_spaces", False):
        return None
    if type(tok)._decode is not TokenizersBackend._decode or type(tok).decode is not TokenizersBackend.decode:
        return None          # a tokenizer class of its own decodes its own way
    return raw


def _advance(
    prefix_text: str, new_text: str, prefix_offset: int, read_offset: int, n_ids: int, flush: bool
) -> tuple[str, int, int]:
    # Byte-level decoding replaces an incomplete trailing UTF-8 sequence with U+FFFD; waiting for it to go
    # away is how we know the tail ends on a character boundary, which is what makes the emitted deltas a
    # prefix of the final text.
    held_back = new_text.endswith(REPLACEMENT_CHAR) and not flush
    if len(new_text) > len(prefix_text) and not held_back:
        # Slicing by length rather than checking startswith: a decoder that rewrites earlier text when more
        # tokens arrive cannot be streamed exactly anyway, and already-sent text cannot be taken back.
        return new_text[len(prefix_text):], read_offset, n_ids
    return "", prefix_offset, read_offset
