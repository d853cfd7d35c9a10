"""Compile workers: persistent spawn-context processes that each build the TokenizerInfo once and
then compile one job at a time, sent over a pipe.

Why processes: an xgrammar compile is C++ that holds a core for as long as the grammar demands (seconds for a long bounded repetition, minutes for pathological nesting) and cannot be
interrupted; the only reliable deadline is killing the process that runs it.

    parent (Worker.run, in a thread)            child (_main)
      send (kind, text, max_blob) ----------->  compile, serialize_json, zlib
      poll(deadline) <-------------------------  ("ok", blob, raw_size, seconds, warnings)
      timeout: kill, caller starts a new one      | ("error" | "too_large", message, warnings)

xgrammar reports what it could not enforce only as warnings on stderr (C++ logging), so the child
points fd 2 at a file and hands back whatever a compile wrote there.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import tempfile
import time
import zlib
from typing import Any

from .keys import JSON_OBJECT_SCHEMA, JSON_OPTIONS

# ("ok", blob, raw_size, compile_s, warnings) | ("error" | "too_large", message, warnings)
Result = tuple

_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+?:\d+: ", re.M)


def clean_message(text: str) -> str:
    """xgrammar's messages minus its '[12:00:00] /project/cpp/x.cc:94: ' prefixes."""
    return _LOG_PREFIX.sub("", str(text)).strip()


class CompileTimeout(Exception):
    pass


class WorkerDied(Exception):
    pass


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
    import xgrammar as xgr
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


def _main(conn: Any, model_dir: str, max_threads: int) -> None:
    err_log = tempfile.TemporaryFile()
    os.dup2(err_log.fileno(), 2)   # shares err_log's file offset: rewound before each job
    try:
        import xgrammar as xgr

        from .tokenizer_info import make_tokenizer_info
        compiler = xgr.GrammarCompiler(make_tokenizer_info(model_dir), max_threads=max_threads, cache_enabled=False)
    except Exception as e:   # stderr goes to err_log now: report why, or the parent only sees an exit
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        kind, text, max_blob = job
        err_log.seek(0)
        err_log.truncate()
        t0 = time.perf_counter()
        try:
            grammar = compile_text(compiler, kind, text)
            compile_s = time.perf_counter() - t0
            raw = grammar.serialize_json().encode()
            blob = zlib.compress(raw, 6)
            out: Result = ("ok", blob, len(raw), compile_s)
            if len(blob) > max_blob:
                out = ("too_large", f"the compiled grammar is {len(blob) / 2**20:.1f} MiB compressed, over the "
                                f"{max_blob / 2**20:.1f} MiB limit; simplify it (deep nesting, many alternatives)")
        except Exception as e:   # invalid regex/EBNF/schema: the caller's input
            out = ("error", clean_message(e))
        err_log.seek(0)
        warnings = [clean_message(line) for line in err_log.read().decode(errors="replace").splitlines()
                    if "Warning" in line]
        conn.send((*out, warnings))


class Worker:
    """Parent-side handle of one compile process. Blocking methods: call them from a thread."""

    def __init__(self, model_dir: str, max_threads: int = 2):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, str(model_dir), max_threads), daemon=True,
                                name="grammar-compile")
        self.proc.start()
        child.close()
        self.jobs = 0

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            self.kill()
            raise WorkerDied(f"grammar worker not ready within {timeout_s:g}s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise WorkerDied(f"grammar worker exited during startup (exit code {self.proc.exitcode})") from None
        if msg != ("ready",):
            self.kill()
            raise WorkerDied(f"grammar worker failed to start: {msg[-1]}")

    def run(self, kind: str, text: str, max_blob: int, deadline_s: float) -> Result:
        self.jobs += 1
        try:
            self.conn.send((kind, text, max_blob))
            if not self.conn.poll(deadline_s):
                self.kill()
                raise CompileTimeout()
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.kill()
            raise WorkerDied(f"grammar worker died (exit code {self.proc.exitcode})") from None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def close(self) -> None:
        """Ask politely (lets the process exit cleanly), then make sure."""
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(2)
        self.kill()
