"""Gateway: one HTTP app's state, held in one object under one AppKey, so that two gateways in
one process share nothing. Every dialect reaches it through the request (`gateway(request)`), and
the helpers below give a request its caller (auth.py) and check what every dialect checks."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from radixflow.shared.bus import Bus
from radixflow.shared.config import GatewayConfig
from radixflow.shared.errors import NotFound, ServiceUnavailable
from radixflow.shared.messages import GenerateRequest, ProgramRequest, Sample

from .auth import Keys, Principal, secret
from .client import EngineClient


@dataclass
class Gateway:
    bus: Bus
    client: EngineClient
    config: GatewayConfig
    keys: Keys
    scrape_token: str = ""          # GET /metrics with it sees every tenant's series (ops.py)
    draining: asyncio.Event = field(default_factory=asyncio.Event)
    counters: defaultdict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))   # (tenant, status)
    health: dict[str, Any] = field(default_factory=dict)     # /health_generate's last run, or the one under way

    @classmethod
    def load(cls, bus: Bus, client: EngineClient, config: GatewayConfig) -> Gateway:
        """The state a config names: its keys and its scrape token, read from their files."""
        return cls(bus, client, config, keys=Keys.load(getattr(config, "auth_file", ""), tuple(config.api_keys)),
                   scrape_token=secret(getattr(config, "metrics_token", ""), getattr(config, "metrics_token_file", "")))

    def tenant_samples(self) -> list[Sample]:
        return [Sample(name="http_requests_total", value=v, labels={"tenant": t, "status": s})
                for (t, s), v in sorted(self.counters.items())]


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal", Principal)


def gateway(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def principal(request: web.Request) -> Principal:
    """Who is calling (a 401 without a valid key when auth is on)."""
    who = request.get(PRINCIPAL)
    if who is None:
        who = request[PRINCIPAL] = gateway(request).keys.principal(request.headers.get("Authorization", ""))
    return who


def request_for(request: web.Request, who: Principal, req: GenerateRequest | ProgramRequest) -> None:
    """Stamp the caller onto a request: tenant, its cache scope, the forced salt, its limits."""
    req.tenant, req.cache_scope, req.limits = who.tenant, who.scope, who.limits
    req.cache_salt = who.salt(req.cache_salt)


def check_open(request: web.Request) -> None:
    if gateway(request).draining.is_set():
        raise ServiceUnavailable("the server is shutting down")


def check_model(request: web.Request, model: str) -> str:
    """The served model a request names. With one model served, any name is taken to mean it (as
    SGLang does: clients written for other servers send their own model names); with several, an
    unknown name is a 404."""
    return resolve_model(sorted({m.model for m in gateway(request).client.models()}), model)


def resolve_model(served: list[str], model: str) -> str:
    if not served:
        raise ServiceUnavailable("no executor is available")
    if model in served or len(served) == 1:
        return model if model in served else served[0]
    raise NotFound(f"the model {model!r} does not exist; served: {', '.join(served)}", param="model")
