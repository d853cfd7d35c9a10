"""xgrammar: compiles ahead of time. The compiled grammar carries a token-mask cache for every
grammar state, so masks are cheap during decoding, but the blob grows with the grammar (quadratic
in the printed grammar's size), and serializing it is what takes the time.

The blob is zlib(CompiledGrammar.serialize_json()): executors and the structured benchmark
deserialize it against their own TokenizerInfo.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from ..cost import AUTO_MAX_PREDICTED_S, xgrammar_compile_s
from ..keys import JSON_OBJECT_SCHEMA, JSON_OPTIONS
from ..tokenizer_info import make_tokenizer_info
from .base import FULL, Backend, Compiled, Grammar, Matcher, OverBudget


def ebnf_literal(s: str) -> str:
    """An EBNF string literal matching exactly `s`: everything outside printable ASCII, and the quote
    and backslash, as \\u/\\U escapes (which xgrammar's EBNF parser decodes)."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch in '"\\' or o < 0x20 or o >= 0x7F:
            out.append(f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


# xgrammar 0.2.9 writes the characters of a length-bounded string (minLength/maxLength) as
# [^"\\\r\n]: raw control characters (tab, U+0000-U+001F) pass, which is invalid JSON (measured: a
# random walk through {"maxLength": 40} emitted "\x1c"). Its unbounded strings use the correct
# class below, so the printed grammar is patched to it and re-parsed (the print/parse round trip
# was checked mask-for-mask on the test corpus). Raw control characters are never valid in JSON,
# so the patch can only remove invalid output. String literals (enum/const text) are left alone.
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'
_LITERAL_OR_CLASS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def json_schema_grammar(schema_text: str) -> Any:
    grammar = xgr.Grammar.from_json_schema(schema_text, **JSON_OPTIONS)
    ebnf = str(grammar)
    if _LOOSE_CHARS not in ebnf:
        return grammar
    patched = _LITERAL_OR_CLASS.sub(lambda m: _JSON_CHARS if m.group() == _LOOSE_CHARS else m.group(), ebnf)
    return xgr.Grammar.from_ebnf(patched)


def compile_text(compiler: Any, kind: str, text: str) -> Any:
    """The xgrammar call for one canonical constraint (see keys.canonicalize)."""
    if kind == "json_schema":
        return compiler.compile_grammar(json_schema_grammar(text))
    if kind == "json_object":
        return compiler.compile_grammar(json_schema_grammar(json.dumps(JSON_OBJECT_SCHEMA)))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(text)))
    raise ValueError(f"unknown kind {kind!r}")


class XGrammarMatcher(Matcher):
    __slots__ = ("backend", "m")

    def __init__(self, backend: "XGrammarBackend", m: "xgr.GrammarMatcher"):
        self.backend = backend
        self.m = m

    def accept_token(self, token: int) -> bool:
        return self.m.accept_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def forced_text(self) -> str:
        return self.m.find_jump_forward_string()

    def legal_prefix(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:     # a refused token leaves xgrammar's state as it was
            if not self.m.accept_token(t):
                break
            n += 1
        if n:
            self.m.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)


class XGrammarGrammar(Grammar):
    def __init__(self, backend: "XGrammarBackend", compiled: "xgr.CompiledGrammar"):
        self.backend = backend
        self.compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.backend, xgr.GrammarMatcher(self.compiled))


class XGrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, model_dir: str | Path, max_threads: int = 2):
        self.info = make_tokenizer_info(model_dir)
        self.max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None

    def compile(self, kind: str, text: str, budgeted: bool = False) -> Compiled:
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=self.max_threads, cache_enabled=False)
        if kind == "json_schema" and budgeted:
            # refused before compiling when the cost model (cost.py) expects it over the budget,
            # counting the time the schema took to print (seconds for some patterns): the compile
            # would go on after the request took llguidance, holding this worker to no use
            t0 = time.perf_counter()
            grammar = json_schema_grammar(text)
            predicted = time.perf_counter() - t0 + xgrammar_compile_s(str(grammar), self.info.vocab_size)
            if predicted > AUTO_MAX_PREDICTED_S:
                raise OverBudget(f"the compile is predicted to take {predicted:.2f}s")
            compiled = self._compiler.compile_grammar(grammar)
        else:
            compiled = compile_text(self._compiler, kind, text)
        # what xgrammar cannot enforce it reports only on stderr: the worker collects that
        return Compiled(compiled.serialize_json().encode(), FULL, [])

    def load(self, raw: bytes) -> XGrammarGrammar:
        return XGrammarGrammar(self, xgr.CompiledGrammar.deserialize_json(raw.decode(), self.info))

    def fill(self, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask, indices=rows)
