"""Helpers shared by the benchmarks: resolve a model, run the whole service stack in-process on an
embedded nats-server, talk HTTP to it."""
from __future__ import annotations

import asyncio
import gc
import importlib
import json
import statistics
import time
from contextlib import asynccontextmanager

import aiohttp

from radixflow.services.modelgen.presets import PRESETS
from radixflow.services.stack import GC_YOUNG_THRESHOLD, Stack, stack_config
from radixflow.shared.config import ExecutorConfig
from radixflow.shared.natsd import NatsServer


def resolve_model(name: str) -> str:
    """A preset name (created in the cache on first use) or a model directory."""
    if name in PRESETS:
        from radixflow.services.modelgen.make import cache_dir, cached_preset
        return str(cached_preset(name, cache_dir()))
    return name


class EngineHost:
    """The in-process Engine baseline in a process of its own, driven over a pipe: `call("module.fn",
    *args)` runs `fn(engine, *args)` of that benchmark module (services/bench/module.py) there and
    returns its result.

    Why not in this process: torch's CPU ops run on an OpenMP thread team per calling thread, and
    a second team (the baseline's, beside the served executor's compute thread) slows the served
    side. Here neither side's threads exist in the other's process, and the two still run in
    alternation, so their ratio is measured in one run."""

    def __init__(self, model: str, **cfg):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host, args=(child, model, cfg), daemon=True)
        self.proc.start()
        child.close()
        ready = self.conn.recv()
        if ready != "ready":
            raise RuntimeError(f"the baseline engine did not start: {ready}")

    def call(self, name: str, *args):
        self.conn.send((name, args))
        ok, out = self.conn.recv()
        if not ok:
            raise RuntimeError(f"baseline engine: {out}")
        return out

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)

    def __enter__(self) -> "EngineHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host(conn, model: str, cfg: dict) -> None:
    try:
        from radixflow.kernels import cpu_ext
        from radixflow.services.executor.engine import Engine, EngineConfig
        from radixflow.services.executor.runner import takes_cpu_kernels
        # as the executor does (service._cpu_kernels): the baseline on the kernels the served side
        # uses, not on the torch references while their build loads
        ecfg = EngineConfig(model=model, **cfg)
        # and with the collector set as a serving stack sets it (stack.Stack.start)
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        if takes_cpu_kernels(ecfg.device, ecfg.kernels) and cpu_ext.enabled():
            cpu_ext.wait(ExecutorConfig().kernel_build_wait_s)
        engine = Engine(ecfg)
    except Exception as e:       # noqa: BLE001 - reported to the parent, which raises it
        conn.send(repr(e))
        return
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        name, args = msg
        try:
            # by name: the benchmark modules import this one, never the other way round
            mod, _, fn = name.rpartition(".")
            where = importlib.import_module(f"radixflow.services.bench.{mod}")
            conn.send((True, getattr(where, fn)(engine, *args)))
        except Exception as e:   # noqa: BLE001
            conn.send((False, repr(e)))


@asynccontextmanager
async def served(model: str, **overrides):
    """The full service path (HTTP -> gateway -> NATS -> ... -> executor) in this process."""
    with NatsServer() as nats:
        stack = await Stack(stack_config(nats.url, model, gw_port=0, **overrides)).start()
        base = f"http://127.0.0.1:{stack.actors['gateway'].port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
            for _ in range(1200):       # up to a minute: ready once the grammar workers have booted
                async with http.get(base + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the stack did not become healthy in 60 s")
            try:
                yield stack, http, base
            finally:
                await stack.stop()


@asynccontextmanager
async def served_executors(model: str, executors: list[dict], **overrides):
    """The full service path with several executors, each with its own ExecutorConfig changes
    (`executors`: e.g. [{"role": "prefill"}, {"role": "decode", "kv_host_pages": 4096}]); yields
    (stack, http, base, executor services) once the scheduler sees them all."""
    import dataclasses

    from radixflow.services.executor.service import ExecutorService
    from radixflow.services.stack import ORDER
    from radixflow.shared.bus import Bus
    with NatsServer(max_payload=8 * 1024 * 1024) as nats:
        cfg = stack_config(nats.url, model, gw_port=0, **overrides)
        stack = await Stack(cfg, names=tuple(n for n in ORDER if n != "executor")).start()
        execs: list[tuple[ExecutorService, Bus]] = []
        try:
            for i, changes in enumerate(executors):
                bus = Bus(f"radixflow-executor-{i}", cfg.bus)
                await bus.connect()
                ex = ExecutorService(bus, dataclasses.replace(cfg.executor, **changes), cfg.service)
                execs.append((ex, bus))
                await ex.start()
            base = f"http://127.0.0.1:{stack.actors['gateway'].port}"
            sched = stack.actors["scheduler"]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
                for _ in range(1200):
                    async with http.get(base + "/health") as r:
                        if r.status == 200 and len(sched.live_executors()) == len(executors):
                            break
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError(f"the stack did not serve with {len(executors)} executors in 60 s")
                yield stack, http, base, [ex for ex, _ in execs]
        finally:
            await stack.stop()
            for ex, bus in execs:
                try:
                    if ex.engine is not None:
                        await ex.drain(5)
                    await ex.stop()
                except Exception:  # noqa: BLE001  an executor a test cut off from the bus stops as it can
                    pass
                await bus.close()


async def generate(http: aiohttp.ClientSession, base: str, body: dict | bytes) -> dict:
    """POST /generate; `body` may come encoded already (see encoded)."""
    async with http.post(base + "/generate", data=body if isinstance(body, bytes) else json.dumps(body)) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(f"/generate {r.status}: {out}")
        return out


def encoded(bodies: list[dict]) -> list[bytes]:
    """Request bodies as JSON, encoded before a timed burst: the client's own encoding is not the
    server's work, and in a served benchmark whose stack shares
    the client's process it would otherwise delay the server by the whole burst's encoding (every
    side of a comparison gets its bodies the same way)."""
    return [json.dumps(b).encode() for b in bodies]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Timer:
    """Wall seconds (s), and the CPU seconds of this process's threads (cpu) and of the thread that
    entered it (thread_cpu: in a served benchmark the event loop's, which runs the stack's services
    and the client; the executor's compute threads are the rest). CPU time counts work, not waits: it
    tells a side that computes on every core (cpu ~ cores x s) from one that waits, and it does not grow
    when another process takes the cores (a machine that runs slower slows both)."""
    def __enter__(self) -> "Timer":
        self.t0, self.c0, self.l0 = time.perf_counter(), time.process_time(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.c0
        self.thread_cpu = time.thread_time() - self.l0
