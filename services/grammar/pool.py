"""The compile workers' pool: persistent worker processes (worker.py), started once, each taken
for one job at a time and given back, a dead or killed one replaced in the background.

At the service's start the workers boot in the background (each a process importing both grammar
engines and building their tokenizer state: seconds of CPU); `booting` counts those of the first
start still coming up, which the gateway's /health waits for.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from radixflow.shared import log

from .worker import Worker, WorkerDied

_log = log.get("grammar")


class WorkerPool:
    def __init__(self, model_dir: str | Path, n: int, max_threads: int, startup_timeout_s: float,
                 threads: ThreadPoolExecutor):
        self.model_dir, self.n, self.max_threads = model_dir, n, max_threads
        self.startup_timeout_s = startup_timeout_s
        self.booting = 0                  # workers of the first start not yet up (or failed once)
        self._threads = threads           # blocking waits on worker startups
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        self._workers: set[Worker] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def start(self, wait: bool = True) -> None:
        """Start the workers; with wait=False in the background (take() then waits for the first)."""
        if wait:
            await asyncio.gather(*(self._add() for _ in range(self.n)))
        else:
            self.booting = self.n
            for _ in range(self.n):
                self._spawn(first=True)

    async def stop(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._threads, w.close) for w in list(self._workers)),
                             return_exceptions=True)
        self._workers.clear()

    async def take(self) -> Worker:
        return await self._idle.get()

    def give(self, w: Worker) -> None:
        self._idle.put_nowait(w)

    def replace(self, dead: Worker) -> None:
        self._workers.discard(dead)
        self._spawn()

    @property
    def ready(self) -> int:
        return self._idle.qsize()

    @property
    def alive(self) -> int:
        return len(self._workers)

    def _start_one(self) -> Worker:
        w = Worker(self.model_dir, self.max_threads)
        w.wait_ready(self.startup_timeout_s)
        if self._closed:   # stopped while this thread waited: nobody else will close it
            w.close()
            raise WorkerDied("the compiler stopped")
        return w

    async def _add(self) -> None:
        w = await asyncio.get_running_loop().run_in_executor(self._threads, self._start_one)
        if self._closed:
            w.close()
            return
        self._workers.add(w)
        self._idle.put_nowait(w)

    def _spawn(self, first: bool = False) -> None:
        async def respawn(first: bool) -> None:
            delay = 0.5
            while not self._closed:
                try:
                    await self._add()
                    return
                except WorkerDied as e:   # keep trying: without workers nothing compiles
                    _log.error("grammar worker failed to start; retrying", error=str(e), retry_s=delay)
                finally:
                    if first:             # booted, or failed once: readiness waits no longer
                        self.booting, first = self.booting - 1, False
                await asyncio.sleep(delay)
                delay = min(2 * delay, 30.0)
        task = asyncio.ensure_future(respawn(first))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
