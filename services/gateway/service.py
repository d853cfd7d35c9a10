"""Gateway service: the HTTP server (app.py) as an actor with the usual lifecycle.
drain() refuses new HTTP requests with 503 and waits for the in-flight ones to finish."""
from __future__ import annotations

import asyncio

from aiohttp import web

from radixflow.shared import subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import GatewayConfig, ServiceConfig
from radixflow.shared.errors import ServiceUnavailable
from radixflow.shared.messages import Heartbeat, Sample

from .app import make_app
from .client import EngineClient
from .state import Gateway


def loopback(host: str) -> bool:
    """Whether binding `host` serves only this machine (a name resolves as the resolver says)."""
    import ipaddress
    import socket
    if host in ("localhost",):
        return True
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addrs = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, None)}
        except OSError:
            return False
    return bool(addrs) and all(a.is_loopback for a in addrs)


class GatewayService(Actor):
    service = "gateway"

    def __init__(self, bus: Bus, config: GatewayConfig, service_config: ServiceConfig | None = None,
                 request_timeout_s: float = 960.0):
        super().__init__(bus, service_config)
        self.cfg = config
        self.client = EngineClient(bus, config.scheduler_timeout_s, request_timeout_s, config.stall_check_s,
                                   origin=self.instance, coalesce=config.coalesce_streams)
        self.gateway = Gateway.load(bus, self.client, config)
        self.app = make_app(self.gateway)
        if not self.gateway.keys and not config.insecure and not loopback(config.host):
            raise ValueError(f"refusing to serve without API keys on {config.host!r}, which is not a loopback "
                             "address: every caller would be the admin. Give --api-key / --auth-file (or "
                             "RADIXFLOW_GATEWAY_API_KEYS), bind 127.0.0.1, or pass --insecure")
        self._runner: web.AppRunner | None = None
        self._inflight = 0
        self.port = config.port
        self.route(subjects.heartbeat("scheduler"), Heartbeat, self.client.on_heartbeat, drain_last=True)
        self.route(subjects.heartbeat("executor"), Heartbeat, self.client.on_heartbeat, drain_last=True)

        @web.middleware
        async def count(request, handler):
            self._inflight += 1
            try:
                return await handler(request)
            finally:
                self._inflight -= 1
        self.app.middlewares.insert(0, count)

    async def on_start(self) -> None:
        self.spawn("watch", self.client.watch)
        # shutdown_timeout: at stop, handlers still running after the drain (and after on_stop ended
        # the streams) are cancelled after this, not after aiohttp's minute: one submitting to, or
        # tokenizing over, a bus that is gone would wait out its own request timeout
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True, shutdown_timeout=3.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, reuse_port=self.cfg.reuse_port or None)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.log.info("http listening", host=self.cfg.host, port=self.port)

    async def drain(self, timeout_s: float | None = None) -> None:
        # HTTP first, while heartbeats still flow (the stream watchdog needs them), then the bus
        self.gateway.draining.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.drain_timeout_s if timeout_s is None else timeout_s)
        while self._inflight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        await super().drain(max(deadline - loop.time(), 0.0))

    async def on_stop(self) -> None:
        # what the drain left in flight (its scheduler, or the bus, gone) ends now with a clear
        # error: the HTTP server's cleanup waits for every handler, up to a minute
        self.client.fail_all(ServiceUnavailable("the gateway is shutting down and the request did not finish "
                                                "within the drain timeout"))
        if self._runner is not None:
            await self._runner.cleanup()

    def status(self) -> dict:
        return {"port": self.port, "inflight_http": self._inflight}

    def metrics(self) -> list[Sample]:
        return [Sample(name="http_inflight", value=self._inflight),
                Sample(name="stream_items_resent_total", value=self.client.resent_total)] + self.gateway.tenant_samples()
