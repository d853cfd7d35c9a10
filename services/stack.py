"""Build and run radixflow's services: all of them in one process (`radixflow up`, tests) or one
(`radixflow service NAME`). Each service gets its own NATS connection, as it would in its own process."""
from __future__ import annotations

import asyncio
import gc
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from radixflow.shared import log
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import BusConfig, ExecutorConfig, GatewayConfig, SchedulerConfig, ServiceConfig, load

# start order: the gateway last, so /health is green only when the rest is up; drain in reverse
ORDER = ("tokenizer", "grammar", "radix", "executor", "scheduler", "gateway")
_log = log.get("stack")
# the young generation's collection threshold while serving (Stack.start says why)
GC_YOUNG_THRESHOLD = 20_000
_stacks_serving = 0                 # stacks serving in this process
_gc_before = gc.get_threshold()     # the threshold before the first of them


def _gc_serving(delta: int) -> None:
    """The first stack to serve in a process raises the threshold, the last to stop restores it."""
    global _stacks_serving, _gc_before
    if delta > 0 and _stacks_serving == 0:
        _gc_before = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *_gc_before[1:])
    _stacks_serving += delta
    if delta < 0 and _stacks_serving == 0:
        gc.set_threshold(*_gc_before)


@dataclass(frozen=True)
class StackConfig:
    bus: BusConfig
    executor: ExecutorConfig
    scheduler: SchedulerConfig
    gateway: GatewayConfig
    service: ServiceConfig = field(default_factory=ServiceConfig)
    grammar_backend: str = "auto"      # xgrammar | llguidance | auto: for requests that name no engine


def build(name: str, bus: Bus, cfg: StackConfig) -> Actor:
    if name == "tokenizer":
        from .tokenizer.service import TokenizerService
        return TokenizerService(bus, cfg.executor.model, cfg.service)
    if name == "grammar":
        from .grammar.service import GrammarService
        return GrammarService(bus, cfg.executor.model, cfg.service, backend=cfg.grammar_backend)
    if name == "radix":
        from .radix.service import RadixService
        return RadixService(bus, cfg.service)
    if name == "executor":
        from .executor.service import ExecutorService
        return ExecutorService(bus, cfg.executor, cfg.service)
    if name == "scheduler":
        from .scheduler.service import SchedulerService
        return SchedulerService(bus, cfg.scheduler, cfg.service)
    if name == "gateway":
        from .gateway.service import GatewayService
        return GatewayService(bus, cfg.gateway, cfg.service, request_timeout_s=cfg.scheduler.request_timeout_s + 60)
    raise ValueError(f"unknown service {name!r}; one of {', '.join(ORDER)}")


class Stack:
    """Some or all services, started in ORDER and drained in reverse."""

    def __init__(self, cfg: StackConfig, names: tuple[str, ...] = ORDER):
        self.cfg = cfg
        self.names = [n for n in ORDER if n in names]
        self.actors: dict[str, Actor] = {}
        self._exit = AsyncExitStack()
        self._serving = False

    async def start(self) -> "Stack":
        # Starting allocates ~10^6 objects that live as long as the process (the modules of torch,
        # transformers and the rest, the model, the tokenizer), and the collector's automatic full
        # collections would walk them all again each time they grew by a quarter. Off while the
        # services start; the one collection below frees what starting left behind.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for n in self.names:
                bus = Bus(f"radixflow-{n}", self.cfg.bus, role=n)
                await bus.connect()
                self._exit.push_async_callback(bus.close)
                actor = build(n, bus, self.cfg)
                await actor.start()
                self.actors[n] = actor
        finally:
            if collecting:
                gc.enable()
        # What startup made lives as long as the process: out of the collector's sight, a full
        # collection walks only what serving made since, not a pause inside a burst of requests.
        gc.collect()
        gc.freeze()
        # Serving's young objects include token-id lists of thousands of items (a prompt's, at each
        # hop and in each message), which a young-generation collection walks item by item with the
        # GIL held (the event loop and the compute thread's step both wait): at Python's default
        # threshold an agent's fan-out meets many; at GC_YOUNG_THRESHOLD about one. Cycles are still
        # collected, only less often; the objects in between are a few MB.
        _gc_serving(+1)
        self._serving = True
        return self

    async def stop(self) -> None:
        # one drain deadline for the whole stack, not one per service: where in-flight work cannot
        # finish (the bus is gone) each service waited out a timeout of its own, one after another
        deadline = time.monotonic() + self.cfg.service.drain_timeout_s
        for n in reversed(self.names):
            a = self.actors.get(n)
            if a is not None:
                await a.drain(max(deadline - time.monotonic(), 0.0))
        for n in reversed(self.names):
            a = self.actors.pop(n, None)
            if a is not None:
                await a.stop()
        await self._exit.aclose()
        # back in the collector's sight: at exit CPython collects what it can see, and objects
        # left frozen are reported as leaks by the libraries that count theirs (triton's nanobind)
        gc.unfreeze()
        if self._serving:
            self._serving = False
            _gc_serving(-1)

    async def __aenter__(self) -> "Stack":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


async def run_until_signal(stack: Stack) -> None:
    """Start, serve until SIGTERM/SIGINT, then drain in-flight work and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stack.start()
    _log.info("ready", services=stack.names)
    await stop.wait()
    _log.info("shutting down: draining in-flight requests")
    await stack.stop()


def stack_config(nats_url: str, model: str, **over) -> StackConfig:
    """Configs from the environment (RADIXFLOW_*), then the command line's overrides."""
    ex = {k[3:]: v for k, v in over.items() if k.startswith("ex_")}
    gw = {k[3:]: v for k, v in over.items() if k.startswith("gw_")}
    sc = {k[3:]: v for k, v in over.items() if k.startswith("sc_")}
    bu = {k[4:]: v for k, v in over.items() if k.startswith("bus_")}
    return StackConfig(bus=load(BusConfig, nats_url=nats_url, **bu), executor=load(ExecutorConfig, model=model, **ex),
                       scheduler=load(SchedulerConfig, **sc), gateway=load(GatewayConfig, **gw),
                       service=load(ServiceConfig), grammar_backend=over.get("gr_backend") or "auto")
