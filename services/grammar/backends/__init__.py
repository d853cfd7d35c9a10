"""Grammar engines behind one interface (base.py): xgrammar (compiled ahead, fast masks, blobs that
grow with the grammar) and llguidance (compiled lazily, small blobs, any schema size).

Which one compiles a request is the compiler's choice (compiler.py, `auto`); which one masks a
request's logits follows from its blob (GrammarBlob.backend).
"""
from __future__ import annotations

from pathlib import Path

from ..keys import BACKENDS
from .base import Backend


def make(name: str, model_dir: str | Path, compile_threads: int = 2) -> Backend:
    if name == "xgrammar":
        from .xgrammar import XGrammarBackend
        return XGrammarBackend(model_dir, compile_threads)
    if name == "llguidance":
        from .llguidance import LLGuidanceBackend
        return LLGuidanceBackend(model_dir)
    raise ValueError(f"unknown grammar backend {name!r}; one of {', '.join(BACKENDS)}")


def make_all(model_dir: str | Path, compile_threads: int = 2) -> tuple[dict[str, Backend], dict[str, str]]:
    """Every engine that can serve this model, and why the others cannot (e.g. llguidance needs a
    fast tokenizer): one engine failing must not take the other down."""
    ready, failed = {}, {}
    for name in BACKENDS:
        try:
            ready[name] = make(name, model_dir, compile_threads)
        except Exception as e:   # whatever the engine raised about this tokenizer
            failed[name] = f"{type(e).__name__}: {e}"
    return ready, failed
