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
    def __init__(self, fetch: Callable[[str, list[int]], int]):
        self._fetch = fetch                          # KVTiers.fetch: (namespace, prompt) -> pages brought up
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}             # rid -> its job, until it is done or settled
        self._mu = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, rid: str, namespace: str, tokens: list[int]) -> None:
        job = _Job(rid, namespace, tokens)
        with self._mu:
            self._jobs[rid] = job
            if self._thread is None:
                # a daemon: an engine nobody closes (tests, a crash) leaves no thread to wait for at exit
                self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
                self._thread.start()
        self._queue.put(job)

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

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
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
