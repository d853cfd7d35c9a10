"""Step by step: for a program whose control flow depends on generated values. Every state runs its
operations in order on a worker thread of its own (so forks generate concurrently), and reading a
value waits for it. Forks still tell the server where they branch: the prefix is prefilled once
before the children start, so their requests reuse it from the cache."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .backend import Backend
from .ir import Gen, Select, parts


def _done(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class EagerState:
    def __init__(self, backend: Backend, start: Future | None = None, speculative: bool = False):
        self._backend = backend
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixflow-state")
        self._text = ""
        self._tail = _done()
        self._speculative = speculative        # step by step, a speculative fork is an ordinary one
        self.vars: dict[str, Any] = {}         # name -> Future of its value, or a list of them
        self._meta: dict[str, Future] = {}
        if start is not None:
            self._then(lambda: setattr(self, "_text", start.result()))

    def _then(self, fn: Callable[[], Any]) -> Future:
        prev = self._tail

        def run():
            prev.result()                      # an earlier failure fails everything after it
            return fn()
        self._tail = self._pool.submit(run)
        return self._tail

    def __iadd__(self, other: Any) -> "EagerState":
        for p in parts(other):
            if isinstance(p, str):
                self._then(lambda p=p: setattr(self, "_text", self._text + p))
            elif isinstance(p, Gen):
                self._value(p.name, lambda p=p: self._backend.generate(self._text, p.params))
            elif isinstance(p, Select):
                self._value(p.name, lambda p=p: self._backend.select(self._text, p.choices))
        return self

    def _value(self, name: str | None, call: Callable[[], dict]) -> None:
        def step():
            out = call()
            self._text += out["output"]
            return out
        fut = self._then(step)
        if name:
            value: Future = Future()
            fut.add_done_callback(lambda f: value.set_exception(f.exception()) if f.exception()
                                  else value.set_result(f.result()["output"]))
            self.vars[name], self._meta[name] = value, fut

    def fork(self, n: int, speculative: bool = False) -> "EagerForks":
        start = self._then(lambda: (self._backend.prefill(self._text), self._text)[1])
        return EagerForks([EagerState(self._backend, start, speculative) for _ in range(n)], self)

    def __getitem__(self, name: str) -> Any:
        v = self.vars[name]
        return [x.result() if x is not None else None for x in v] if isinstance(v, list) else v.result()

    def meta_info(self, name: str) -> dict:
        return self._meta[name].result()["meta_info"]

    def text(self) -> str:
        self._tail.result()
        return self._text

    def wait(self) -> "EagerState":
        self._tail.result()
        return self


class EagerForks(list):
    def __init__(self, states: list[EagerState], parent: EagerState):
        super().__init__(states)
        self.parent = parent

    def join(self) -> None:
        for f in self:
            f.wait()
        names: list[str] = []
        for f in self:
            names += [k for k in f.vars if k not in names]
        for k in names:
            self.parent.vars[k] = [f.vars.get(k) for f in self]
