"""Operations: /health, /metrics (Prometheus), /v1/memory, /flush_cache, /openapi.json."""
from __future__ import annotations

import asyncio
import hashlib
import hmac

import msgspec
from aiohttp import web

from radixflow.shared import subjects
from radixflow.shared.errors import RadixflowError
from radixflow.shared.messages import (MemoryReply, MetricsReply, RadixFlush, RadixFlushed, Sample, StatusReply,
                                       StatusRequest)

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from . import protocol as P
from .auth import Principal
from .metrics import Gathered
from .openapi import spec
from .state import gateway, principal


async def health(request: web.Request) -> web.Response:
    """200 only when every service answers its status request, an executor is serving a model
    (known to both the scheduler and this gateway, so a request sent now can run) and the grammar
    service's compile workers have started."""
    gw = gateway(request)
    bus, cfg = gw.bus, gw.config

    async def ask(service: str) -> StatusReply | None:
        try:
            return await bus.request(subjects.status(service), StatusRequest(), StatusReply, timeout=cfg.health_timeout_s,
                                     idempotent=True)
        except RadixflowError:
            return None
    names = [s for s in subjects.SERVICES if s != "gateway"]
    replies = dict(zip(names, await asyncio.gather(*(ask(s) for s in names))))
    ok = {n: r is not None for n, r in replies.items()}
    ok["scheduler"] = ok["scheduler"] and bool(replies["scheduler"].detail.get("executors"))
    ok["executor"] = ok["executor"] and bool(gw.client.models())
    # the grammar service answers at once but boots its compile workers in the background, seconds
    # of CPU on every core: ready only after, or the first requests' model steps run beside them
    ok["grammar"] = ok["grammar"] and not replies["grammar"].detail.get("workers_booting", 0)
    ok["gateway"] = not gw.draining.is_set()
    healthy = all(ok.values())
    return web.json_response({"status": "ok" if healthy else "unavailable", "services": ok}, status=200 if healthy else 503)


async def flush_cache(request: web.Request) -> web.Response:
    """Empty the unlocked KV pages of the caller's cache namespaces (what running requests hold
    stays). Every tenant's: an admin key with {"all": true}, or auth off."""
    who = principal(request)
    raw = await request.read()
    body = P.decode_body(raw, P.FlushBody) if raw.strip() else P.FlushBody()
    if body.all:
        who.require_admin("flushing every tenant's cache")
    gw = gateway(request)
    everything = body.all or not gw.keys      # auth off: there is one tenant
    namespaces = [] if everything else who.flushable()
    out = await gw.bus.request(subjects.RADIX_FLUSH, RadixFlush(namespaces=namespaces), RadixFlushed,
                                         timeout=10)
    return web.json_response({"message": "cache flushed", "freed_pages": out.freed_pages,
                              "namespaces": namespaces or "all"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: every instance's samples, gathered over the bus, written by prometheus-client
    (metrics.py)."""
    # every instance answers within 0.2 s while idle; a busy one can answer later, and a series
    # missing from one scrape reads as a counter reset. So the scrape also waits (up to 2 s) for
    # the instances it knows of: the live executors and schedulers (their heartbeats), itself, and
    # one each of tokenizer, grammar and radix
    everyone = scrape_token_ok(request)
    who = None if everyone else principal(request)     # no key, no token: 401
    everyone = everyone or who.role == "admin"
    gw = gateway(request)
    known = len(gw.client.executors()) + len(gw.client.schedulers()) + 4
    replies = await gw.bus.gather(subjects.METRICS, StatusRequest(), MetricsReply, window_s=2.0,
                                            expect=known, min_s=0.2)
    if not everyone:
        replies = [only_own(r, who) for r in replies]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Gathered(replies))
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST,
                                                                 "X-Content-Type-Options": "nosniff"})


def scrape_token_ok(request: web.Request) -> bool:
    """Whether the caller shows the scrape token (a monitoring system's: every tenant's series)."""
    token = gateway(request).scrape_token
    given = request.headers.get("Authorization", "")
    given = given[7:].strip() if given[:7].lower() == "bearer " else ""
    return bool(token) and hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                                               hashlib.sha256(token.encode()).digest())


def only_own(reply: MetricsReply, who: Principal) -> MetricsReply:
    """A tenant's view: series labelled with another tenant (or another cache scope, whose page
    counts would tell what others have cached) are left out; unlabelled ones are kept."""
    def own(s: Sample) -> bool:
        return s.labels.get("tenant", who.tenant) == who.tenant and s.labels.get("scope", who.scope) == who.scope
    return msgspec.structs.replace(reply, samples=[s for s in reply.samples if own(s)])


async def memory(request: web.Request) -> web.Response:
    """Realized memory of every executor (bytes per token, per state slot, dtypes, pool sizes) with
    its pool's occupancy as the radix service sees it."""
    principal(request)
    gw = gateway(request)
    bus = gw.bus
    # every live executor answers (up to 2 s for a busy one), not those that made a fixed 0.2 s
    live = len(gw.client.executors())
    reports = await bus.gather(subjects.MEMORY, StatusRequest(), MemoryReply, window_s=2.0 if live else 0.2, expect=live)
    try:
        pools = (await bus.request(subjects.status("radix"), StatusRequest(), StatusReply, timeout=2)).detail.get("pools", {})
    except RadixflowError:
        pools = {}
    return web.json_response({"executors": [
        {"instance": r.instance, "model": r.model} | r.report | {"occupancy": pools.get(r.instance, {})}
        for r in sorted(reports, key=lambda r: r.instance)]})


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(spec())


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/memory", memory)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/flush_cache", flush_cache)      # SGLang serves both
    app.router.add_get("/openapi.json", openapi_json)
