"""Compile workers: persistent spawn-context processes that each build every grammar engine's
tokenizer state once (backends.make_all) and then compile one job at a time, sent over a pipe.

Why processes: an xgrammar compile is C++ that holds a core for as long as the grammar demands
(seconds for a long bounded repetition, minutes for pathological nesting) and cannot be
interrupted; the only reliable deadline is killing the process that runs it. llguidance compiles
in milliseconds, but shares the workers so both engines get the same deadline and isolation.

    parent (Worker.run, in a thread)                      child (_main)
      send (backend, kind, text, max_blob, budgeted) -->  Backend.compile, zlib
      poll(deadline) <-----------------------------------  ("ok", blob, raw_size, seconds, enforcement, notes, warnings)
      timeout: kill, caller starts a new one                | ("error" | "too_large" | "over_budget", message, warnings)

xgrammar reports what it could not enforce only as warnings on stderr (C++ logging), so the child
points fd 2 at a file and hands back whatever a compile wrote there.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import re
import tempfile
import time
import zlib
from typing import Any

from .backends.base import OverBudget

Result = tuple   # see the diagram above

_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+?:\d+: ", re.M)


def clean_message(text: str) -> str:
    """xgrammar's messages minus its '[12:00:00] /project/cpp/x.cc:94: ' prefixes."""
    return _LOG_PREFIX.sub("", str(text)).strip()


class CompileTimeout(Exception):
    pass


class WorkerDied(Exception):
    pass


def _main(conn: Any, model_dir: str, max_threads: int) -> None:
    err_log = tempfile.TemporaryFile()
    os.dup2(err_log.fileno(), 2)   # shares err_log's file offset: rewound before each job
    try:
        from .backends import make_all
        backends, unavailable = make_all(model_dir, max_threads)
    except Exception as e:   # stderr goes to err_log now: report why, or the parent only sees an exit
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    if not backends:
        conn.send(("failed", "; ".join(f"{n}: {why}" for n, why in unavailable.items())))
        return
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        name, kind, text, max_blob, budgeted = job
        err_log.seek(0)
        err_log.truncate()
        t0 = time.perf_counter()
        try:
            if name not in backends:
                raise ValueError(f"the {name} grammar engine cannot serve this model: {unavailable[name]}")
            compiled = backends[name].compile(kind, text, budgeted)
            compile_s = time.perf_counter() - t0
            blob = zlib.compress(compiled.raw, 6)
            out: Result = ("ok", blob, len(compiled.raw), compile_s, compiled.enforcement, compiled.notes)
            if len(blob) > max_blob:
                out = ("too_large", f"the compiled grammar is {len(blob) / 2**20:.1f} MiB compressed, over the "
                                f"{max_blob / 2**20:.1f} MiB limit; simplify it (deep nesting, many alternatives)")
        except OverBudget as e:
            out = ("over_budget", str(e))
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

    def run(self, backend: str, kind: str, text: str, max_blob: int, deadline_s: float,
            budgeted: bool = False) -> Result:
        self.jobs += 1
        try:
            self.conn.send((backend, kind, text, max_blob, budgeted))
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
