"""Grammar service: will compile JSON Schema / regex / EBNF with xgrammar and cache the results
(the structured-output issue). Today it answers status; the message contracts (GrammarCompile,
GrammarFetch) are defined in shared/messages.py."""
from __future__ import annotations

from radixflow.shared.actor import Actor


class GrammarService(Actor):
    service = "grammar"

    def status(self) -> dict:
        import xgrammar
        from importlib.metadata import version
        return {"xgrammar": version("xgrammar"), "cached": 0, "backend": xgrammar.__name__}
