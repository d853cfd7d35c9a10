"""@function: a Python function over a program state, run as one radixflow program.

    @function
    def agent(s, task):
        s += PREAMBLE
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Plan {i} for {task}:" + gen("plan", max_tokens=64)
        forks.join()
        s += "Best:" + select("best", choices=s["plan"])

    out = agent.run(task="...", backend=Runtime("http://127.0.0.1:8000"))
    out["best"], out["plan"], out.text()

`run` first traces the function (nothing is generated) and, when its control flow does not depend
on generated values, sends the whole DAG as one program: shared parents computed once, siblings
batched. When it does (it compares or inspects a generated value), it runs step by step instead
(eager.py). The function may therefore be called twice: once traced, once for real.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .backend import Backend, ProgramError, default_backend
from .eager import EagerState
from .ir import Var
from .trace import Trace, TraceState


class ProgramResult:
    """The outcome of a traced run: values by name, the root state's text, each value's meta_info."""

    def __init__(self, response: dict[str, Any], state: TraceState, trace: Trace):
        self.response = response
        self.program_id = response.get("id")
        self.nodes: dict[str, dict] = response.get("nodes", {})
        self._state, self._trace = state, trace

    def _value(self, v: Any) -> Any:
        if isinstance(v, list):
            return [self._value(x) for x in v]
        if v is None:
            return None
        n = self.nodes.get(v.node)
        if n is None or n["state"] != "done":
            err = (n or {}).get("error") or {}
            raise ProgramError(f"node {v.node!r}: {err.get('message', (n or {}).get('state', 'missing'))}",
                               err.get("code", 500))
        return n["output"]

    def __getitem__(self, name: str) -> Any:
        return self._value(self._state.vars[name])

    def meta_info(self, name: str) -> Any:
        v = self._state.vars[name]
        return [self.nodes[x.node]["meta_info"] for x in v] if isinstance(v, list) else self.nodes[v.node]["meta_info"]

    def text(self) -> str:
        """The root state's full text: every node on its chain, text then output, plus trailing text."""
        parent = {n["id"]: n.get("parent") for n in self._trace.nodes}
        chain, nid = [], self._state._node
        while nid is not None:
            chain.append(nid)
            nid = parent[nid]
        out = "".join(self.nodes[i]["text"] + self.nodes[i]["output"] for i in reversed(chain))
        return out + self._state._pending


class Function:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "function")
        self.__doc__ = fn.__doc__

    def trace(self, *args: Any, **kwargs: Any) -> tuple[list[dict], TraceState, Trace]:
        """The program's nodes, without running anything; raises when the flow depends on values."""
        trace = Trace()
        state = TraceState(trace)
        self.fn(state, *args, **kwargs)
        return trace.nodes, state, trace

    def run(self, *args: Any, backend: Backend | None = None, timeout: float | None = None,
            **kwargs: Any) -> ProgramResult | EagerState:
        backend = backend or default_backend()
        try:
            nodes, state, trace = self.trace(*args, **kwargs)
        except Exception:          # the flow reads generated values (or tracing met a bug): run it for real
            return self.run_eager(*args, backend=backend, **kwargs)
        if not nodes:
            return ProgramResult({"nodes": {}}, state, trace)
        return ProgramResult(backend.run_program(nodes, timeout), state, trace)

    def run_eager(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> EagerState:
        state = EagerState(backend or default_backend())
        self.fn(state, *args, **kwargs)
        return state.wait()

    def run_batch(self, batch: list[dict[str, Any]], backend: Backend | None = None, num_threads: int = 16,
                  timeout: float | None = None) -> list[ProgramResult | EagerState]:
        """One run per kwargs dict, concurrently (the server batches what they share)."""
        backend = backend or default_backend()
        with ThreadPoolExecutor(max(1, min(num_threads, len(batch)))) as pool:
            return list(pool.map(lambda kw: self.run(backend=backend, timeout=timeout, **kw), batch))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Function:
    return Function(fn)


__all__ = ["function", "Function", "ProgramResult", "Var"]
