"""llguidance: compiles lazily. Its lexer and parser work out each token mask during decoding, so
"compiling" is only translating and validating the constraint (milliseconds, even for a large
schema), and the blob is the translated grammar text, about the schema's size. That suits large schemas and many-$ref schemas, where xgrammar's blob explodes.

JSON schemas are compiled `lenient` (keywords llguidance does not implement, such as not,
if/then/else, uniqueItems, contains, dependentRequired or an unknown format, are ignored instead of
refused) and with `coerce_one_of` (oneOf written as anyOf). Either makes the enforcement CHECKED:
the finished output is validated and resampled when it fails. So is any `format`, whose regexes
approximate the formats' rules. What llguidance refuses even then (lookaround, backreferences,
remote $refs) is a 400.

Departures from JSON Schema that keep output valid: properties come in declared order, whitespace
between tokens is 1-2 characters (as keys.JSON_OPTIONS gives xgrammar). Unlike xgrammar's strict
mode, an object without `additionalProperties: false` may get properties beyond those declared.
"""
from __future__ import annotations

from pathlib import Path

import llguidance as llg
import torch

from ..keys import JSON_OBJECT_SCHEMA, LLGUIDANCE_JSON_OPTIONS
from ..tokenizer_info import make_ll_tokenizer
from .base import CHECKED, FULL, Backend, Compiled, Grammar, Matcher


class LLGuidanceMatcher(Matcher):
    __slots__ = ("backend", "m", "_terminated")

    def __init__(self, backend: "LLGuidanceBackend", m: "llg.LLMatcher"):
        self.backend = backend
        self.m = m
        self._terminated = False

    def accept_token(self, token: int) -> bool:
        if not self.m.consume_token(token):
            return False
        # llguidance stops by itself once nothing can follow ("NoExtension"), before any stop token;
        # xgrammar's meaning is kept: terminated when a stop token was accepted
        self._terminated = token in self.backend.stop_ids
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_text(self) -> str:
        if self._terminated or self.m.is_stopped():
            return ""
        # whole characters only, as xgrammar gives them: nothing when the bytes start inside a
        # character (after a token that split one), and the end cut before a split one
        raw = self.m.compute_ff_bytes()
        if raw[:1] and 0x80 <= raw[0] < 0xC0:
            return ""
        for cut in range(len(raw), max(len(raw) - 4, 0) - 1, -1):
            try:
                return raw[:cut].decode()
            except UnicodeDecodeError:
                continue
        return ""

    def legal_prefix(self, tokens: list[int]) -> int:
        # consume_token on a refused token would put the matcher in its error state
        return self.m.validate_tokens(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)
            self._terminated = False


class LLGuidanceGrammar(Grammar):
    def __init__(self, backend: "LLGuidanceBackend", template: "llg.LLMatcher"):
        self.backend = backend
        self.template = template    # never advanced; building a matcher from the text again costs ms

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.backend, self.template.deep_copy())


def _schema_checked(text: str) -> bool:
    """Formats are approximated; a property or enum value named "format" only costs a needless check."""
    return '"format"' in text


class LLGuidanceBackend(Backend):
    name = "llguidance"

    def __init__(self, model_dir: str | Path):
        self.tokenizer = make_ll_tokenizer(model_dir)
        self.stop_ids = frozenset(self.tokenizer.eos_tokens)
        self._executor: llg.LLExecutor | None = None

    def _grammar(self, kind: str, text: str) -> tuple[str, bool]:
        """The llguidance grammar of a canonical constraint, and whether its output must be checked."""
        if kind == "json_schema":
            # llguidance does not check that the schema is valid ({"minLength": -1} passes): the
            # compiler does, before it sends the job
            return llg.LLMatcher.grammar_from_json_schema(text, overrides=LLGUIDANCE_JSON_OPTIONS), _schema_checked(text)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA, overrides=LLGUIDANCE_JSON_OPTIONS), False
        if kind in ("regex", "ebnf", "choice"):
            return llg.grammar_from(kind, text), False
        raise ValueError(f"unknown kind {kind!r}")

    def compile(self, kind: str, text: str, budgeted: bool = False) -> Compiled:
        grammar, checked = self._grammar(kind, text)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise ValueError(messages[0])
        # with lenient/coerce_one_of every warning names something ignored or approximated
        return Compiled(grammar.encode(), CHECKED if checked or messages else FULL, messages)

    def load(self, raw: bytes) -> LLGuidanceGrammar:
        template = llg.LLMatcher(self.tokenizer, raw.decode(), log_level=0)
        if template.is_error():
            raise ValueError(f"llguidance could not load the grammar: {template.get_error()}")
        return LLGuidanceGrammar(self, template)

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        # llguidance.torch.fill_next_token_bitmask_par without importing llguidance.torch, whose
        # torch.compile decorator costs seconds of import
        if self._executor is None:
            self._executor = llg.LLExecutor()
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.is_contiguous()
        n, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr([(m.m, r) for m, r in zip(matchers, rows)], bitmask.data_ptr(),
                                               words * 4, n)
