"""Compiler: constraint -> cached, compiled grammar, never blocking the event loop.

    compile(kind, spec, backend)
      backend auto? -> the rule in _auto, which compiles with one engine or both as below
      canonicalize -> key (engine included) -> cache hit? return   (microseconds: no lint, no compile)
      in flight for this key? await that compile      (single flight: one compile per key)
      prepare (xgrammar, json_schema: normalize, relax; lint.prepare) -> idle worker -> compile
      in its process with the chosen engine (backends/), killed at the deadline
      (llguidance refused a JSON schema's regex? once more with it widened: checked)
      -> what xgrammar warned it cannot enforce: checked (JSON schema) or refused (other kinds)
      -> cache (engine, enforcement)

A stuck compile holds one worker; the others keep serving. A killed worker is replaced in the
background (a fresh process takes seconds to import the engines and build their tokenizer state).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path


from radixflow.shared import log, patterns
from radixflow.shared.errors import BadRequest, RadixflowError

from .cache import CacheEntry, GrammarCache
from radixflow.shared.histogram import Histogram
from .backends.base import CHECKED, FULL
from .keys import BACKENDS, Canonical, canonicalize, grammar_key
from . import drafts
from .lint import bounded_formats, prepare, widen_for_llguidance
from .merge import Unsupported
from .resources import for_engines
from .tokenizer_info import tokenizer_identity
from .pool import WorkerPool
from .worker import CompileTimeout, Result, Worker, WorkerDied

BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
REFUSED_TTL_S = 600.0
REFUSED_MAX = 1024
_WHAT = {"json_schema": "the JSON schema", "json_object": "json_object", "regex": "the regex",
         "ebnf": "the EBNF grammar", "choice": "the choice list"}
# Weakenings xgrammar announces that lint.needs_validation already flags (the output is validated).
# Any other warning means part of the constraint would not hold: a JSON schema's output is then
# checked (validated and resampled); a regex, EBNF or choice, which nothing checks, is refused.
_VALIDATED_WARNINGS = ("oneOf with overlapping", "pattern combined with minLength/maxLength",
                       "format combined with minLength/maxLength")
# auto: JSON schemas longer than this go to llguidance first (see Compiler._auto)
AUTO_MAX_SCHEMA_BYTES = 32 << 10
TOO_LARGE = "schema too large"     # llguidance's refusal of a schema past its node limit
# auto: an xgrammar job still running this long after a worker took it leaves the request to
# llguidance. Half the 1 s compile target: what the cost model (cost.py) wrongly lets through then
# costs the request this, the lint and an llguidance compile (milliseconds), still under 1 s.
AUTO_BUDGET_S = 0.5
# the lint matches a schema's own patterns against its enum values and property names: all of one
# schema's matching gets this long, past it the schema is refused (a backtracking pattern)
PATTERN_BUDGET_S = 1.0
_log = log.get("grammar")


def _budgeted(fn, *args):
    """fn(*args) with the schema's pattern matching under PATTERN_BUDGET_S (in a lint thread: the
    `regex` engine releases the GIL while it matches, so the event loop keeps running)."""
    try:
        with patterns.budget(PATTERN_BUDGET_S):
            return fn(*args)
    except patterns.PatternTimeout as e:
        raise BadRequest(f"the schema was refused: {e.describe()}", param="response_format") from None


class _OverBudget(BadRequest):
    """An auto try of xgrammar gave up (over the budget); auto then takes llguidance."""


class _SchemaRefused(BadRequest):
    """The schema itself is refused (invalid under its draft, unsatisfiable, too deep): final for
    auto too, whichever engine could have compiled the rest. What the lint only cannot rewrite for
    xgrammar (merge.Unsupported) is not final: auto tries llguidance."""


@dataclass(frozen=True)
class Compiled:
    key: str
    size: int            # bytes of the uncompressed serialization
    compile_s: float     # 0 on a cache hit; under auto, every engine it tried
    cache_hit: bool
    enforcement: str = "full"   # "checked": the output must be validated (lint.prepare, or the engine's report)
    backend: str = "xgrammar"   # the engine that compiled it (its executor side masks the logits)


class Compiler:
    def __init__(self, model_dir: str | Path, *, deadline_s: float = 10.0, cache_bytes: int = 256 << 20,
                 workers: int = 2, max_blob_bytes: int | None = None, max_threads: int = 2,
                 startup_timeout_s: float = 120.0, backend: str = "auto", auto_budget_s: float = AUTO_BUDGET_S):
        if backend not in (*BACKENDS, "auto"):
            raise ValueError(f"unknown grammar backend {backend!r}; one of {', '.join(BACKENDS)}, auto")
        self.model_dir = str(model_dir)
        self.deadline_s = deadline_s
        self.backend = backend             # what a request that names no engine gets
        # auto: a request whose xgrammar job runs longer than this on its worker takes llguidance
        # (the job itself goes on to the deadline: killing it at the budget would, under load, kill
        # compiles that are only slow for lack of CPU, and each respawn costs seconds of CPU more)
        self.auto_budget_s = auto_budget_s
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
        self._inflight: dict[str, asyncio.Future] = {}
        self._started: dict[str, asyncio.Event] = {}   # in-flight job -> set once a worker runs it
        # key -> (400 message, expiry, its class): a resent bad or hostile grammar is refused at
        # once instead of occupying a worker again (expiring, since a deadline also depends on the
        # load then)
        self._refused: OrderedDict[str, tuple[str, float, type[BadRequest]]] = OrderedDict()
        # blocking pipe waits and worker startups; lint of big schemas
        self._threads = ThreadPoolExecutor(2 * workers + 2, thread_name_prefix="grammar")
        self.pool = WorkerPool(self.model_dir, workers, max_threads, startup_timeout_s, self._threads)

    # ------------------------------------------------------------ lifecycle

    async def start(self, wait_workers: bool = True) -> None:
        """Load the tokenizer identity and start the workers. With wait_workers=False the workers
        come up in the background (seconds: a process importing both engines and building their
        tokenizer state) and early compiles wait for the first one; a bad model path still fails
        here, on the identity."""
        loop = asyncio.get_running_loop()
        self.identity = await loop.run_in_executor(self._threads, tokenizer_identity, self.model_dir)
        await self.pool.start(wait=wait_workers)

    async def stop(self) -> None:
        await self.pool.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)

    @property
    def workers_booting(self) -> int:
        return self.pool.booting

    @property
    def workers_ready(self) -> int:
        return self.pool.ready

    @property
    def workers_alive(self) -> int:
        return self.pool.alive

    # ------------------------------------------------------------ compile / fetch

    async def compile(self, kind: str, spec: str, backend: str = "") -> Compiled:
        """Compile with `backend` (xgrammar | llguidance | auto; "": this compiler's default)."""
        canon = canonicalize(kind, spec)
        choice = backend or self.backend
        if choice == "auto":
            return await self._auto(canon)
        if choice not in BACKENDS:
            raise BadRequest(f"unknown grammar backend {choice!r}; one of {', '.join(BACKENDS)}, auto", param="backend")
        return await self._compile(canon, choice)

    async def _auto(self, canon: Canonical) -> Compiled:
        """The `auto` rule: xgrammar when it enforces the whole constraint within the budget (the
        lint finds nothing it must leave to the output check, it prints no warning, the cost model
        (cost.py) expects the compile within the budget and the job takes under auto_budget_s);
        otherwise llguidance when that enforces all of it; otherwise whichever compiles, xgrammar
        first (llguidance first for a length-bounded format or pattern, which only it enforces). A
        schema the lint refuses outright (invalid, unsatisfiable) is refused, not handed to
        llguidance; one the lint only cannot rewrite for xgrammar (merge.Unsupported: $dynamicRef,
        a reference outside the schema) goes to llguidance. Schemas over AUTO_MAX_SCHEMA_BYTES
        (generated API schemas: many $refs, which blow up xgrammar's blob) go to llguidance first,
        and to xgrammar only when llguidance refuses them. When llguidance refuses a schema that
        xgrammar only compiles slowly, xgrammar gets it after all, up to the deadline. A hit on
        either engine's entry costs a hash and a lookup each (microseconds)."""
        t0 = time.perf_counter()
        large = canon.kind == "json_schema" and len(canon.text) > AUTO_MAX_SCHEMA_BYTES
        order = ("llguidance", "xgrammar") if large else ("xgrammar", "llguidance")
        first = first_error = None

        def spent(r: Compiled) -> Compiled:
            # what auto cost this request is every try, an xgrammar try that ran out of budget
            # included, not only the compile of the engine it returns; 0 when it only found hits
            if r.cache_hit and first_error is None and (first is None or first.cache_hit):
                return r
            return replace(r, compile_s=time.perf_counter() - t0)

        try:
            first = await self._compile(canon, order[0], budgeted=order[0] == "xgrammar")
            if first.enforcement == FULL or large:
                return spent(first)
        except _SchemaRefused:
            raise
        except BadRequest as e:
            first_error = e
        # the first try got past the schema's validity check (or found it cached, or refused for
        # what comes after the check): the second need not run it again (the slow part of a lint)
        try:
            second = await self._compile(canon, order[1], budgeted=order[1] == "xgrammar", checked=True)
        except BadRequest as e:
            if first is not None:
                return spent(first)
            xgrammar_error = first_error if order[0] == "xgrammar" else e
            if isinstance(xgrammar_error, _OverBudget):
                # llguidance refuses what xgrammar only compiles slowly: better slow than refused
                return spent(await self._xgrammar_to_deadline(canon))
            # both refused: the first engine's reason
            raise first_error from None
        if first is None or second.enforcement == FULL:
            return spent(second)
        # both leave something to the output check. xgrammar gets the normalized schema and so
        # enforces more, except for a length bound beside a format or pattern: xgrammar drops the
        # bound (a string a random-ish model may never end), llguidance intersects the two
        if second.backend == "llguidance" and canon.kind == "json_schema" and bounded_formats(json.loads(canon.text)):
            return spent(second)
        return spent(first)

    async def _xgrammar_to_deadline(self, canon: Canonical) -> Compiled:
        """xgrammar without the auto budget: the auto try still running for this schema when there
        is one (it goes on to the deadline), else a compile of its own (the cost model refused the
        auto try before it started)."""
        key = grammar_key(canon, self.identity, "xgrammar")
        running = self._inflight.get(key + "/auto")
        if running is not None:
            try:
                entry = await asyncio.shield(running)
                return Compiled(key, entry.raw_size, entry.compile_s, False, entry.enforcement, "xgrammar")
            except _OverBudget:
                pass
        return await self._compile(canon, "xgrammar", checked=True)

    async def _compile(self, canon: Canonical, backend: str, budgeted: bool = False, checked: bool = False) -> Compiled:
        key = grammar_key(canon, self.identity, backend)
        entry = self.cache.get(key)
        if entry is not None:
            return Compiled(key, entry.raw_size, 0.0, True, entry.enforcement, backend)
        # a budgeted (auto) try is its own job: its failures refuse only auto's next try, and an
        # explicit request never waits on, or inherits the budget of, an auto one
        job = key + "/auto" if budgeted else key
        now = time.monotonic()
        for k in (key, job):
            refused = self._refused.get(k)
            if refused is not None and refused[1] > now:
                raise refused[2](refused[0], param="response_format")
        fut = self._inflight.get(job)
        if fut is None:
            started = self._started[job] = asyncio.Event()
            fut = self._inflight[job] = asyncio.ensure_future(self._compile_miss(canon, key, backend, budgeted,
                                                                                 started, checked))
            fut.add_done_callback(lambda f: self._settled(job, f))
        else:
            self.coalesced += 1
        # a waiter that gives up does not cancel the others' compile
        entry = await (self._within_budget(job, fut) if budgeted else asyncio.shield(fut))
        return Compiled(key, entry.raw_size, entry.compile_s, False, entry.enforcement, backend)

    async def _within_budget(self, job: str, fut: asyncio.Future) -> CacheEntry:
        """The job's entry if its worker finishes it within auto_budget_s (the clock starts when a
        worker takes it: waiting in the queue is not the engine's fault); else _OverBudget, and
        auto's next requests skip this job until it is cached (or fails at its deadline)."""
        started = self._started.get(job)
        if started is not None and not fut.done():
            waiter = asyncio.ensure_future(started.wait())
            await asyncio.wait({fut, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.auto_budget_s)
        except asyncio.TimeoutError:
            why = f"compiling took longer than the auto budget of {self.auto_budget_s:g}s"
            self._refuse(job, why, _OverBudget)
            raise _OverBudget(why, param="response_format") from None

    def _settled(self, key: str, fut: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        self._started.pop(key, None)
        if fut.cancelled():
            return
        err = fut.exception()   # retrieved even when every waiter gave up, so asyncio does not warn
        if isinstance(err, BadRequest):
            self._refuse(key, err.message, type(err))

    def _refuse(self, key: str, message: str, cls: type[BadRequest]) -> None:
        self._refused[key] = (message, time.monotonic() + REFUSED_TTL_S, cls)
        self._refused.move_to_end(key)
        while len(self._refused) > REFUSED_MAX:
            self._refused.popitem(last=False)

    def fetch(self, key: str) -> CacheEntry | None:
        return self.cache.peek(key)

    async def _compile_miss(self, canon: Canonical, key: str, backend: str, budgeted: bool,
                            started: asyncio.Event, checked: bool = False) -> CacheEntry:
        # compile_s is what the miss cost the request (lint, waiting for a worker, compile, serialize,
        # compress), which is what the histogram should show; the engine's own share is logged
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        text, enforcement = canon.text, FULL
        if canon.kind == "json_schema" and backend == "xgrammar":
            # the key stays that of the schema as sent (a hit needs no normalization); the worker
            # compiles the prepared one. llguidance takes the schema as sent: it reports itself what
            # it ignores (backends/llguidance.py)
            try:
                prepared, enforcement = await loop.run_in_executor(self._threads, _budgeted, prepare, canon.value, checked)
            except Unsupported:
                raise                    # xgrammar's refusal only: auto tries llguidance
            except BadRequest as e:
                raise _SchemaRefused(e.message, param=e.param) from None
            text = json.dumps(prepared, separators=(",", ":"), ensure_ascii=False)
        elif canon.kind == "json_schema":
            if not checked:
                try:
                    await loop.run_in_executor(self._threads, _budgeted, drafts.check, canon.value)
                except BadRequest as e:      # invalid: final for auto's xgrammar try too
                    raise _SchemaRefused(e.message, param=e.param) from None
            # references into embedded resources as local pointers, and no root $id they do not
            # need: llguidance resolves a $ref against an $id only when it has no fragment
            local = for_engines(canon.value, drafts.id_keyword(canon.value))
            if local is not canon.value:
                text = json.dumps(local, separators=(",", ":"), ensure_ascii=False)
        started_once = False

        async def run(job_text: str) -> Result:
            nonlocal started_once
            worker = await self.pool.take()
            if not started_once:
                started.set()
                started_once = True
            return await self._run(worker, canon.kind, key, backend, job_text, budgeted)

        result = await run(text)
        if result[0] == "error" and backend == "llguidance" and canon.kind == "json_schema":
            # llguidance expands a schema into at most 50,000 nodes, and a sibling distributed into a
            # large anyOf at every use (a CI config's hundreds of tasks) passes that; it refuses a
            # recursive $ref with keywords beside it (a schema that extends a metaschema), and a
            # schema with a definition nothing satisfies even where it may be absent (octokit's
            # webhooks). Prepared as for xgrammar (the same meaning: allOf merged, enum-only
            # branches joined, repeats shared as $defs, such a definition gone; or wider, and then
            # checked) it has none of these
            try:
                prepared, level = await loop.run_in_executor(self._threads, _budgeted, prepare, canon.value, True)
            except BadRequest:
                prepared = None
            if prepared is not None:
                retry = await run(json.dumps(prepared, separators=(",", ":"), ensure_ascii=False))
                if retry[0] == "ok" or TOO_LARGE in result[1]:
                    result = retry
                    enforcement = CHECKED if level == CHECKED else enforcement
        if result[0] == "error" and backend == "llguidance" and canon.kind == "json_schema":
            # llguidance refuses some regexes (lookarounds, \A, \b) and gives up intersecting a
            # pattern with a long length bound: the schema widened there, and the output checked
            wider = await loop.run_in_executor(self._threads, _budgeted, widen_for_llguidance, canon.value)
            if wider is not None:
                retry = await run(json.dumps(wider, separators=(",", ":"), ensure_ascii=False))
                if retry[0] == "ok":
                    result, enforcement = retry, CHECKED
        status, warnings = result[0], result[-1]
        if status == "over_budget":
            raise _OverBudget(f"{backend} would exceed the auto budget: {result[1]}", param="response_format")
        if status != "ok":
            self.failures += 1
            why = result[1] if status == "too_large" else f"{_WHAT[canon.kind]} does not compile: {result[1]}"
            raise BadRequest(why, param="response_format")
        _, blob, raw_size, engine_s, engine_enforcement, notes, _ = result
        if backend == "xgrammar":
            allowed = _VALIDATED_WARNINGS if canon.kind == "json_schema" else ()
            unenforced = [w for w in warnings if not any(a in w for a in allowed)]
            if unenforced and canon.kind != "json_schema":
                self.failures += 1
                raise BadRequest(f"{_WHAT[canon.kind]} cannot be enforced exactly: {unenforced[0]}",
                                 param="response_format")
            if unenforced:
                # what xgrammar ignores beyond what the lint foresaw (an anchor mid-pattern, an escape
                # it reads literally): the finished output is validated against the schema as sent
                # and resampled, as for any checked construct
                enforcement = CHECKED
                notes = [*notes, *unenforced]
        if engine_enforcement == CHECKED:
            enforcement = CHECKED
        compile_s = time.perf_counter() - t0
        self.compile_seconds.observe(compile_s)
        _log.debug("grammar compiled", kind=canon.kind, key=key[:16], backend=backend, enforcement=enforcement,
                   seconds=round(compile_s, 4), engine_s=round(engine_s, 4), raw_bytes=raw_size,
                   blob_bytes=len(blob), notes=notes[:3])
        entry = CacheEntry(blob, raw_size, compile_s, backend, enforcement)
        self.cache.put(key, entry)
        return entry

    async def _run(self, worker: Worker, kind: str, key: str, backend: str, text: str, budgeted: bool) -> Result:
        """One job on `worker` (taken from the idle queue; put back unless it died)."""
        self.compiles += 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._threads, worker.run, backend, kind, text, self.max_blob_bytes, self.deadline_s, budgeted)
        except CompileTimeout:
            self.timeouts += 1
            self.pool.replace(worker)
            _log.warning("grammar compile hit the deadline; worker replaced", kind=kind, key=key[:16],
                         backend=backend, deadline_s=self.deadline_s)
            raise BadRequest(f"compiling this grammar took longer than {self.deadline_s:g}s; simplify it "
                             "(deep nesting, large ranges, long alternations)", param="response_format") from None
        except WorkerDied as e:
            self.failures += 1
            self.pool.replace(worker)
            _log.error("grammar worker died while compiling", kind=kind, key=key[:16], error=str(e))
            raise RadixflowError(f"the grammar compiler crashed on {_WHAT[kind]}: {e}") from None
        self.pool.give(worker)
        return result

    def stats(self) -> dict:
        return {**self.cache.stats(), "compiles": self.compiles, "failures": self.failures, "refused": len(self._refused),
                "timeouts": self.timeouts, "coalesced": self.coalesced, "workers_alive": self.workers_alive,
                "workers_booting": self.pool.booting, "workers_idle": self.workers_ready, "deadline_s": self.deadline_s, "backend": self.backend,
                "max_blob_bytes": self.max_blob_bytes}
