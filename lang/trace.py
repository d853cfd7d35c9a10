"""Tracing: run a program function once against placeholder states and record the DAG it builds.

    s += text        text waits in the state until a gen / select / fork needs a node
    s += gen("x")    a node: parent = the state's last node, text = the waiting text, gen
    s.fork(n)        the waiting text becomes a prefill node; n states continue from it
    forks.join()     the forks' variables become lists in the parent (SGLang's gather)
    s["x"]           a Var placeholder; used inside text it makes the node a join ({node} + after)

Nothing runs while tracing; the nodes are sent as one program afterwards.
"""
from __future__ import annotations

import re
from typing import Any

from .ir import Concat, Gen, NeedsValue, Select, Var, parts, references


class Trace:
    """The nodes of one traced call, in creation order (a valid topological order)."""

    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self._ids: set[str] = set()

    def new_id(self, name: str | None) -> str:
        base = re.sub(r"[^A-Za-z0-9_.:-]", "_", name or "n")[:48] or "n"
        k = len(self.nodes)
        nid = f"{base}-{k}"
        while nid in self._ids:
            k += 1
            nid = f"{base}-{k}"
        self._ids.add(nid)
        return nid

    def add(self, parent: str | None, text: str, speculative: bool, **kind: Any) -> str:
        text, after = references(text)
        for c in kind.get("select", {}).get("choices", []):
            after += [r for r in references(c)[1] if r not in after]
        if "select" in kind:
            kind["select"]["choices"] = [references(c)[0] for c in kind["select"]["choices"]]
        nid = self.new_id(kind.pop("name", None))
        node = {"id": nid, "text": text} | ({"parent": parent} if parent else {}) | ({"after": after} if after else {}) \
            | ({"speculative": True} if speculative else {}) | kind
        self.nodes.append(node)
        return nid


class TraceState:
    """A program state while tracing."""

    def __init__(self, trace: Trace, parent: str | None = None, speculative: bool = False):
        self._trace = trace
        self._node = parent               # the last node: what the next node continues from
        self._pending = ""                # text appended since
        self._speculative = speculative
        self.vars: dict[str, Any] = {}    # name -> Var, or a list of them after a join

    def __iadd__(self, other: Any) -> "TraceState":
        for p in parts(other):
            if isinstance(p, str):
                self._pending += p
            elif isinstance(p, Gen):
                self._emit(p.name, gen=dict(p.params))
            elif isinstance(p, Select):
                self._emit(p.name, select={"choices": list(p.choices)})
        return self

    def _emit(self, name: str | None, **kind: Any) -> str:
        if self._node is None and not self._pending:
            raise ValueError("a program must start with text before gen / select")
        nid = self._trace.add(self._node, self._pending, self._speculative, name=name, **kind)
        self._node, self._pending = nid, ""
        if name:
            self.vars[name] = Var(nid)
        return nid

    def fork(self, n: int, speculative: bool = False) -> "ForkGroup":
        if self._pending or self._node is None:
            self._emit(None)              # the shared parent: prefilled once, pinned while the forks run
        return ForkGroup([TraceState(self._trace, self._node, speculative or self._speculative) for _ in range(n)],
                         self)

    def __getitem__(self, name: str) -> Any:
        return self.vars[name]

    def text(self) -> str:
        raise NeedsValue("text() of a state whose output is generated at run time")


class ForkGroup(list):
    def __init__(self, states: list, parent: Any):
        super().__init__(states)
        self.parent = parent

    def join(self) -> None:
        """The forks' variables, gathered into the parent as lists (in fork order)."""
        names: list[str] = []
        for f in self:
            names += [k for k in f.vars if k not in names]
        for k in names:
            self.parent.vars[k] = [f.vars.get(k) for f in self]


__all__ = ["Trace", "TraceState", "ForkGroup", "NeedsValue", "Concat"]
