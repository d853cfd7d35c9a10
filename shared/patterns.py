"""Regular expressions from callers (a JSON schema's `pattern` and `patternProperties`), matched
where a deadline can stop them and without holding the GIL.

Python's `re` backtracks without bound and holds the GIL while it does: one schema with
`"pattern": "^(?=(a+)+b)a{30}$"` froze a scheduler's event loop (and so every tenant's requests,
its heartbeats and /health) for tens of seconds. Here a pattern runs on the `regex` package
(re-compatible syntax, a transformers dependency already), which takes a timeout and, with
`concurrent=True`, releases the GIL while it matches.

    with patterns.budget(1.0):            # every match in this block: 1 s of matching in all
        validator.iter_errors(value)      # jsonschema's pattern keywords land in search() below
    -> PatternTimeout (a clear error for that request) once the budget is spent

Outside a budget each match gets CALL_S on its own. jsonschema has no hook for its regex engine
(its keyword functions call `re.search` directly, in three modules), so `install()` points those
modules' `re` at a shim whose `search` is ours and whose every other name is the real `re`;
tests/test_patterns.py fails if a jsonschema release moves its matching elsewhere.
"""
from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Iterator

import regex

CALL_S = 0.1          # one match outside a budget
_local = threading.local()


class PatternTimeout(Exception):
    """A pattern ran past its budget (it backtracks without bound on this input)."""

    def __init__(self, pattern: str):
        super().__init__(pattern)
        self.pattern = pattern

    def describe(self) -> str:
        shown = self.pattern if len(self.pattern) <= 80 else self.pattern[:77] + "..."
        return (f"matching the pattern {shown!r} ran past its time budget (a pattern that backtracks "
                "without bound, such as nested repetition); simplify it")


@contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Every match in this thread, inside the block, draws on `seconds` of matching time in all
    (the time spent between matches, validating the rest, does not count)."""
    before = getattr(_local, "left", None)
    _local.left = seconds
    try:
        yield
    finally:
        _local.left = before


@lru_cache(maxsize=1024)
def _compiled(pattern: str, flags: int) -> Any:
    try:
        return regex.compile(pattern, flags)
    except regex.error as e:
        raise re.error(str(e), pattern) from None     # what callers of `re` expect


def search(pattern: Any, string: str, flags: int = 0) -> Any:
    """re.search, within what is left of the enclosing budget (or CALL_S); PatternTimeout past it."""
    if isinstance(pattern, re.Pattern):
        pattern, flags = pattern.pattern, pattern.flags & ~re.UNICODE
    left = getattr(_local, "left", None)
    allowed = CALL_S if left is None else left
    if allowed <= 0:
        raise PatternTimeout(str(pattern))
    t0 = time.perf_counter()
    try:
        return _compiled(pattern, flags).search(string, timeout=allowed, concurrent=True)
    except TimeoutError:
        raise PatternTimeout(str(pattern)) from None
    finally:
        if left is not None:
            _local.left = left - (time.perf_counter() - t0)


class _ReShim:
    """What jsonschema's modules see as `re`: our search, the real module for the rest."""

    search = staticmethod(search)

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)


_JSONSCHEMA_MODULES = ("jsonschema._keywords", "jsonschema._utils", "jsonschema._legacy_keywords")


def install() -> None:
    """Route jsonschema's pattern matching through search() (idempotent)."""
    import importlib
    shim = _ReShim()
    for name in _JSONSCHEMA_MODULES:
        mod = importlib.import_module(name)
        if getattr(mod, "re", None) is re:
            mod.re = shim


install()

__all__ = ["PatternTimeout", "budget", "search", "install", "CALL_S"]
