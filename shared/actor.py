"""The actor base every service is a thin shell of.

    NATS subs --intake--> mailbox --N workers--> handler(msg) --> reply (or ErrorReply)
                          ordered route: its own mailbox, one worker (per-sender order kept)

- handlers are registered per subject with the message type they accept (`route`);
- concurrency is bounded by the number of workers (ServiceConfig.concurrency);
- lifecycle is explicit: start() subscribes and spawns loops, drain() stops intake and waits for
  in-flight work, stop() cancels what is left;
- every loop (workers, heartbeat, a service's own loops via `spawn`) runs under a supervisor that
  logs a crash and restarts the loop;
- `rf.<service>.status` and `rf.heartbeat.<service>` come for free.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription

from . import log, messages, subjects
from .bus import Bus, is_json
from .config import ServiceConfig
from .errors import BadRequest, Overloaded, from_exception
from .messages import Heartbeat, MetricsReply, Msg, Sample, StatusReply, StatusRequest

Handler = Callable[[Any], Awaitable[Msg | None]]
DRAIN_MIN_S = 0.1


@dataclass
class Route:
    subject: str
    msg_type: Any
    fn: Handler
    queue: str = ""
    ordered: bool = False
    mailbox: asyncio.Queue | None = None
    # kept while draining: what in-flight work still needs (outputs, aborts, peers' heartbeats);
    # the rest (new work) is unsubscribed first
    drain_last: bool = False
    queued: int = 0              # its messages waiting in a mailbox (Actor.queued)


def make_instance_id(service: str) -> str:
    # the id is a NATS subject token: a dotted host name (host.example.com) would split it
    host = socket.gethostname().replace(".", "-").replace("*", "-").replace(">", "-") or "host"
    return f"{service}-{host}-{os.getpid()}-{secrets.token_hex(3)}"


class Actor:
    service: ClassVar[str] = "actor"

    def __init__(self, bus: Bus, config: ServiceConfig | None = None, instance: str | None = None):
        self.bus = bus
        self.config = config or ServiceConfig()
        self.instance = instance or make_instance_id(self.service)
        self.log = log.get(self.service).bind(instance=self.instance)
        self._routes: list[Route] = []
        self._subs: list[tuple[Route, Subscription]] = []
        self._mailbox: asyncio.Queue[tuple[Route, NatsMsg]] = asyncio.Queue()
        self._loops: dict[str, asyncio.Task] = {}
        self._started = False
        self.restarts = 0
        self.refused = 0          # requests refused at a full mailbox
        self.route(subjects.status(self.service), StatusRequest, self._on_status, queue=self.service)
        self.route(subjects.METRICS, StatusRequest, self._on_metrics)
        # a watchdog that missed this instance's beats asks it directly before declaring it dead
        self.route(subjects.ping(self.service, self.instance), StatusRequest, self._on_ping, drain_last=True)

    # ------------------------------------------------------------ to override

    async def on_start(self) -> None:
        """Open resources (load a model, connect a client) before intake starts."""

    async def on_drain(self) -> None:
        """Finish in-flight work after intake stopped."""

    async def on_stop(self) -> None:
        """Release resources."""

    def status(self) -> dict[str, Any]:
        return {}

    def heartbeat_detail(self) -> dict[str, Any]:
        return {}

    def metrics(self) -> list[Sample]:
        """Prometheus samples of this instance (served on rf.metrics, rendered by the gateway)."""
        return []

    # ------------------------------------------------------------ wiring

    def route(self, subject: str, msg_type: Any, fn: Handler, *, queue: str = "", ordered: bool = False,
              drain_last: bool = False) -> None:
        if self._started:
            raise RuntimeError("routes are registered before start()")
        self._routes.append(Route(subject, msg_type, fn, queue, ordered, asyncio.Queue() if ordered else None,
                                  drain_last))

    def queued(self, subject: str) -> int:
        """Messages of `subject`'s route received and not yet handled."""
        return sum(r.queued for r in self._routes if r.subject == subject)

    def spawn(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        """Run factory() as a supervised loop: restarted (and logged) if it crashes."""
        self._loops[name] = asyncio.create_task(self._supervise(name, factory), name=f"{self.service}:{name}")

    async def _supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a loop died: log it, restart it, keep serving
                self.restarts += 1
                self.log.error("loop crashed; restarting", loop=name, error=repr(e), exc_info=e)
                await asyncio.sleep(0.05)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.on_start()
        self._started = True
        for i in range(self.config.concurrency):
            self.spawn(f"worker-{i}", lambda: self._work(self._mailbox))
        for r in self._routes:
            if r.ordered:
                self.spawn(f"ordered:{r.subject}", lambda q=r.mailbox: self._work(q))
            self._subs.append((r, await self.bus.subscribe(r.subject, self._intake(r), queue=r.queue)))
        self.spawn("heartbeat", self._heartbeat)
        self.log.info("started", routes=[r.subject for r in self._routes])

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop taking new work, then wait (bounded) until every accepted piece is done; the routes
        that in-flight work still needs (drain_last) go last."""
        await self._unsubscribe(lambda r: not r.drain_last)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.drain_timeout_s if timeout_s is None else timeout_s)
        # at least a moment each, past the deadline too: wait_for(x, 0) times out even what is done
        # already (3.11), and on_drain is where an executor's last outputs go out
        left = lambda: max(deadline - loop.time(), DRAIN_MIN_S)
        queues = [self._mailbox] + [r.mailbox for r in self._routes if r.mailbox is not None]
        try:
            await asyncio.wait_for(asyncio.gather(*(q.join() for q in queues)), left())
            await asyncio.wait_for(self.on_drain(), left())
        except asyncio.TimeoutError:
            self.log.warning("drain timed out", timeout_s=timeout_s)
        await self._unsubscribe(lambda r: True)

    async def _unsubscribe(self, which: Callable[[Route], bool]) -> None:
        keep = []
        for r, s in self._subs:
            if not which(r):
                keep.append((r, s))
                continue
            try:
                await s.unsubscribe()
            except Exception:  # connection already gone: nothing more will arrive anyway
                pass
        self._subs = keep

    async def stop(self) -> None:
        for t in self._loops.values():
            t.cancel()
        await asyncio.gather(*self._loops.values(), return_exceptions=True)
        self._loops.clear()
        await self.on_stop()
        self.log.info("stopped")

    # ------------------------------------------------------------ internals

    def _intake(self, r: Route) -> Callable[[NatsMsg], Awaitable[None]]:
        q = r.mailbox if r.ordered else self._mailbox
        limit = self.config.max_mailbox

        async def cb(m: NatsMsg) -> None:
            # a full mailbox refuses new requests at once (429) instead of growing without bound;
            # messages nobody waits on (outputs, beats) are still taken: dropping them loses work
            if m.reply and q.qsize() >= limit:
                self.refused += 1
                await self.bus.respond(m, Overloaded(f"{self.service} has {q.qsize()} messages waiting; try again "
                                                     "later", retry_after=1.0).to_reply())
                return
            r.queued += 1
            q.put_nowait((r, m))
        return cb

    async def _work(self, q: asyncio.Queue) -> None:
        while True:
            r, m = await q.get()
            r.queued -= 1
            try:
                await self._handle(r, m)
            finally:
                q.task_done()

    async def _handle(self, r: Route, m: NatsMsg) -> None:
        req, rid = None, None
        try:
            if is_json(m):
                req = messages.decode_json(m.data, r.msg_type)
                if hasattr(req, "json_stream"):
                    req.json_stream = True      # its stream items go back in JSON too
            else:
                req = messages.decode(m.data, r.msg_type)
            rid = getattr(req, "rid", None)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            out = BadRequest(f"malformed message on {r.subject}: {e}").to_reply()
        # every line logged while handling a request carries its id
        with log.bind_request(rid) if rid else contextlib.nullcontext():
            if req is not None:
                try:
                    out = await r.fn(req)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    level = "warning" if getattr(e, "code", 500) < 500 else "error"
                    getattr(self.log, level)("handler failed", subject=r.subject, error=str(e))
                    out = from_exception(e)
            if out is not None and m.reply:
                await self.bus.respond(m, out)

    async def _on_status(self, _: StatusRequest) -> StatusReply:
        return StatusReply(service=self.service, instance=self.instance, ok=True, detail=self.status())

    async def _on_ping(self, _: StatusRequest) -> StatusReply:
        return StatusReply(service=self.service, instance=self.instance, ok=True)

    async def _on_metrics(self, _: StatusRequest) -> MetricsReply:
        samples = self.metrics()
        for s in samples:
            s.labels = {"service": self.service, "instance": self.instance} | s.labels
        return MetricsReply(service=self.service, instance=self.instance, samples=samples)

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self.bus.publish(subjects.heartbeat(self.service), Heartbeat(
                    service=self.service, instance=self.instance, ts=time.time(), detail=self.heartbeat_detail()))
                if self.config.alive_file:     # a container's health check (`radixflow alive`)
                    with open(self.config.alive_file, "a"):
                        os.utime(self.config.alive_file)
            except Exception as e:  # disconnected: nats-py reconnects; keep beating
                self.log.debug("heartbeat not sent", error=str(e))
            await asyncio.sleep(self.config.heartbeat_s)
