"""Compiler: constraint -> cached, compiled grammar, never blocking the event loop.

    compile(kind, spec)
      canonicalize -> key -> cache hit? return       (microseconds: no lint, no compile)
      in flight for this key? await that compile      (single flight: one compile per key)
      lint (json_schema) -> idle worker -> compile in its process, killed at the deadline
      -> reject output xgrammar warned it cannot enforce -> cache

A stuck compile holds one worker; the others keep serving. A killed worker is replaced in the
background (a fresh process needs ~2 s to import xgrammar and build its TokenizerInfo).
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from radixflow.shared import log
from radixflow.shared.errors import BadRequest, RadixflowError

from .cache import CacheEntry, GrammarCache
from .histogram import Histogram
from .keys import Canonical, canonicalize, grammar_key
from .lint import check_schema
from .tokenizer_info import tokenizer_identity
from .worker import CompileTimeout, Worker, WorkerDied

BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
REFUSED_TTL_S = 600.0
REFUSED_MAX = 1024
_WHAT = {"json_schema": "the JSON schema", "json_object": "json_object", "regex": "the regex",
         "ebnf": "the EBNF grammar", "choice": "the choice list"}
# Weakenings xgrammar announces that lint.needs_validation already flags (the output is validated);
# any other warning means part of the constraint would silently not hold: the request is refused.
_VALIDATED_WARNINGS = ("oneOf with overlapping", "pattern combined with minLength/maxLength",
                       "format combined with minLength/maxLength")
_log = log.get("grammar")


@dataclass(frozen=True)
class Compiled:
    key: str
    size: int            # bytes of the uncompressed serialization
    compile_s: float     # 0 on a cache hit
    cache_hit: bool


class Compiler:
    def __init__(self, model_dir: str | Path, *, deadline_s: float = 10.0, cache_bytes: int = 256 << 20,
                 workers: int = 2, max_blob_bytes: int | None = None, max_threads: int = 2,
                 startup_timeout_s: float = 120.0):
        self.model_dir = str(model_dir)
        self.deadline_s = deadline_s
        self.cache = GrammarCache(cache_bytes)
        # a blob the cache cannot hold could never be fetched
        self.max_blob_bytes = min(max_blob_bytes or cache_bytes, cache_bytes)
        self.n_workers = workers
        self.max_threads = max_threads
        self.startup_timeout_s = startup_timeout_s
        self.identity = ""
        self.compile_seconds = Histogram("grammar_compile_seconds", BUCKETS)
        self.compiles = 0         # jobs sent to a worker
        self.failures = 0         # of those: invalid input, too large, unenforceable
        self.timeouts = 0         # of those: killed at the deadline
        self.coalesced = 0        # requests that waited on another request's compile
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        self._workers: set[Worker] = set()
        self._inflight: dict[str, asyncio.Future] = {}
        # key -> (400 message, expiry): a resent bad or hostile grammar is refused at once instead
        # of occupying a worker again (expiring, since a deadline also depends on the load then)
        self._refused: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        # blocking pipe waits and worker startups; lint of big schemas
        self._threads = ThreadPoolExecutor(2 * workers + 2, thread_name_prefix="grammar")
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    async def start(self, wait_workers: bool = True) -> None:
        """Load the tokenizer identity and start the workers. With wait_workers=False the workers
        come up in the background (~2 s: a process importing xgrammar) and early compiles wait
        for the first one; a bad model path still fails here, on the identity."""
        loop = asyncio.get_running_loop()
        self.identity = await loop.run_in_executor(self._threads, tokenizer_identity, self.model_dir)
        if wait_workers:
            await asyncio.gather(*(self._add_worker() for _ in range(self.n_workers)))
        else:
            for _ in range(self.n_workers):
                self._spawn_worker()

    async def stop(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._threads, w.close) for w in list(self._workers)),
                             return_exceptions=True)
        self._workers.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _start_worker(self) -> Worker:
        w = Worker(self.model_dir, self.max_threads)
        w.wait_ready(self.startup_timeout_s)
        if self._closed:   # stopped while this thread waited: nobody else will close it
            w.close()
            raise WorkerDied("the compiler stopped")
        return w

    async def _add_worker(self) -> None:
        w = await asyncio.get_running_loop().run_in_executor(self._threads, self._start_worker)
        if self._closed:
            w.close()
            return
        self._workers.add(w)
        self._idle.put_nowait(w)

    def _replace(self, dead: Worker) -> None:
        self._workers.discard(dead)
        self._spawn_worker()

    def _spawn_worker(self) -> None:
        async def respawn() -> None:
            delay = 0.5
            while not self._closed:
                try:
                    await self._add_worker()
                    return
                except WorkerDied as e:   # keep trying: without workers nothing compiles
                    _log.error("grammar worker failed to start; retrying", error=str(e), retry_s=delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 30.0)
        task = asyncio.ensure_future(respawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def workers_ready(self) -> int:
        return self._idle.qsize()

    @property
    def workers_alive(self) -> int:
        return len(self._workers)

    # ------------------------------------------------------------ compile / fetch

    async def compile(self, kind: str, spec: str) -> Compiled:
        canon = canonicalize(kind, spec)
        key = grammar_key(canon, self.identity)
        entry = self.cache.get(key)
        if entry is not None:
            return Compiled(key, entry.raw_size, 0.0, True)
        refused = self._refused.get(key)
        if refused is not None and refused[1] > time.monotonic():
            raise BadRequest(refused[0], param="response_format")
        fut = self._inflight.get(key)
        if fut is None:
            fut = self._inflight[key] = asyncio.ensure_future(self._compile_miss(canon, key))
            fut.add_done_callback(lambda f: self._settled(key, f))
        else:
            self.coalesced += 1
        entry = await asyncio.shield(fut)   # a waiter that gives up does not cancel the others' compile
        return Compiled(key, entry.raw_size, entry.compile_s, False)

    def _settled(self, key: str, fut: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        if fut.cancelled():
            return
        err = fut.exception()   # retrieved even when every waiter gave up, so asyncio does not warn
        if isinstance(err, BadRequest):
            self._refused[key] = (err.message, time.monotonic() + REFUSED_TTL_S)
            self._refused.move_to_end(key)
            while len(self._refused) > REFUSED_MAX:
                self._refused.popitem(last=False)

    def fetch(self, key: str) -> bytes | None:
        entry = self.cache.peek(key)
        return entry.data if entry is not None else None

    async def _compile_miss(self, canon: Canonical, key: str) -> CacheEntry:
        # compile_s is what the miss cost the request (lint, waiting for a worker, compile, serialize,
        # compress), which is what the histogram should show; xgrammar's own share is logged
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        if canon.kind == "json_schema":
            await loop.run_in_executor(self._threads, check_schema, canon.value)
        worker = await self._idle.get()
        self.compiles += 1
        try:
            result = await loop.run_in_executor(self._threads, worker.run, canon.kind, canon.text,
                                                self.max_blob_bytes, self.deadline_s)
        except CompileTimeout:
            self.timeouts += 1
            self._replace(worker)
            _log.warning("grammar compile hit the deadline; worker replaced", kind=canon.kind, key=key[:16],
                         deadline_s=self.deadline_s)
            raise BadRequest(f"compiling this grammar took longer than {self.deadline_s:g}s; simplify it "
                             "(deep nesting, large ranges, long alternations)", param="response_format") from None
        except WorkerDied as e:
            self.failures += 1
            self._replace(worker)
            _log.error("grammar worker died while compiling", kind=canon.kind, key=key[:16], error=str(e))
            raise RadixflowError(f"the grammar compiler crashed on {_WHAT[canon.kind]}: {e}") from None
        self._idle.put_nowait(worker)
        status, warnings = result[0], result[-1]
        if status != "ok":
            self.failures += 1
            why = result[1] if status == "too_large" else f"{_WHAT[canon.kind]} does not compile: {result[1]}"
            raise BadRequest(why, param="response_format")
        allowed = _VALIDATED_WARNINGS if canon.kind == "json_schema" else ()
        unenforced = [w for w in warnings if not any(a in w for a in allowed)]
        if unenforced:
            self.failures += 1
            raise BadRequest(f"{_WHAT[canon.kind]} cannot be enforced exactly: {unenforced[0]}",
                             param="response_format")
        _, blob, raw_size, xgrammar_s, _ = result
        compile_s = time.perf_counter() - t0
        self.compile_seconds.observe(compile_s)
        _log.debug("grammar compiled", kind=canon.kind, key=key[:16], seconds=round(compile_s, 4),
                   xgrammar_s=round(xgrammar_s, 4), raw_bytes=raw_size, blob_bytes=len(blob))
        entry = CacheEntry(blob, raw_size, compile_s)
        self.cache.put(key, entry)
        return entry

    def stats(self) -> dict:
        return {**self.cache.stats(), "compiles": self.compiles, "failures": self.failures, "refused": len(self._refused),
                "timeouts": self.timeouts, "coalesced": self.coalesced, "workers_alive": self.workers_alive,
                "workers_idle": self.workers_ready, "deadline_s": self.deadline_s,
                "max_blob_bytes": self.max_blob_bytes}
