"""tokenizer_config.json as transformers reads it: written by make.py for the local tokenizer and by
qwen35_tokenizer.py for Qwen3.5's (each passes its added tokens and chat template)."""
from __future__ import annotations

from .chat_formats import CHATML
from .train_tokenizer import SPECIAL_TOKENS


def tokenizer_config(added: list[tuple[int, str, bool]] | None = None, model_max_length: int = 32768,
                     chat_template: str = CHATML, bos: str | None = None, eos: str = "<|im_end|>") -> dict:
    """tokenizer_config.json's contents; `added`: (id, text, special) of the tokenizer's added tokens
    (default: the local tokenizer's, all special)."""
    if added is None:
        added = [(i, text, True) for i, text in enumerate(SPECIAL_TOKENS)]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        # Space clean-up would rewrite " ." to "." and break decode(encode(s)) == s.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": special}
            for i, text, special in added
        },
        "chat_template": chat_template,
    }
