"""Prefetcher: the disk tier's pages of a request are read into the host tier by a thread of their own
while the request waits for admission, so that its load at admission (KVTiers.load) copies from host
memory instead of reading and checking files on the compute thread between two steps.

    add(req) ──submit──> [queue] ──thread: KVTiers.fetch (file reads, checksums)──> host tier
    admission ──settle──> a job not started is dropped (the load reads what it needs itself),
                          one being read is waited for (it is ahead of a read starting now)

A prefetch is a hint: whatever it did not bring up in time (or brought up and lost again to the host
tier's LRU) the load reads from disk as before, so outputs never depend on its timing.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from radixflow.shared import log

_log = log.get("executor")


@dataclass(eq=False)
class _Job:
    rid: str
    namespace: str
    tokens: list[int]
    started: bool = False
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class Prefetcher:
    IDLE_S = 5.0      # the thread ends after this long without a job (and starts again with the next)

    def __init__(self, fetch: Callable[[str, list[int]], int]):
        self._fetch = fetch                          # KVTiers.fetch: (namespace, prompt) -> pages brought up
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}             # rid -> its job, until it is done or settled
        self._mu = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, rid: str, namespace: str, tokens: list[int]) -> None:
        job = _Job(rid, namespace, tokens)
        with self._mu:
            self._jobs[rid] = job
            self._queue.put(job)
            if self._thread is None:
                # a daemon that ends when idle: an engine nobody closes (tests, benchmarks) is not kept
                # alive by it, nor is a thread left to wait for at exit
                self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
                self._thread.start()

    def settle(self, rid: str) -> None:
        """rid is being admitted: drop its job if it has not started, wait for it if it has."""
        with self._mu:
            job = self._jobs.pop(rid, None)
            if job is None:
                return
            if not job.started:
                job.cancelled = True
                return
        job.done.wait()

    def pending(self) -> int:
        with self._mu:
            return len(self._jobs)

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._mu:           # submit puts under _mu: nothing slips in between
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            with self._mu:
                if job.cancelled:
                    continue
                job.started = True
            try:
                self._fetch(job.namespace, job.tokens)
            except Exception as e:         # a hint failed: the load at admission reads for itself
                _log.error("prefetch failed", rid=job.rid, error=repr(e), exc_info=e)
            finally:
                job.done.set()
                with self._mu:
                    if self._jobs.get(job.rid) is job:
                        del self._jobs[job.rid]
