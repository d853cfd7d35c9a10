"""The HTTP surface (aiohttp), split by dialect:

    openai.py    /v1/completions, /v1/chat/completions, /v1/models
    native.py    SGLang's /generate, /tokenize, /detokenize, /get_model_info, /get_server_info, /health_generate
    programs.py  /v1/programs
    ops.py       /health, /metrics, /v1/memory, /flush_cache, /openapi.json

This module holds what they share: the error middleware (errors are always JSON in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}), the caller's identity (auth.py) and how it
shapes a request (tenant, cache scope, forced salt, limits), and the per-tenant counters.
"""
from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from radixflow.shared import log
from radixflow.shared.bus import Bus
from radixflow.shared.errors import NotFound, RadixflowError, ServiceUnavailable
from radixflow.shared.messages import GenerateRequest, ProgramRequest, Sample

from .auth import Keys, Principal
from .client import EngineClient
from .sse import error_body

_log = log.get("gateway")
CLIENT: web.AppKey[EngineClient] = web.AppKey("client", EngineClient)
BUS: web.AppKey[Bus] = web.AppKey("bus", Bus)
CONFIG: web.AppKey[Any] = web.AppKey("config", object)
SCRAPE_TOKEN: web.AppKey[str] = web.AppKey("scrape_token", str)
MAX_BODY = 8 * 1024 * 1024      # the bus's max_payload (natsd.py): what one submission can carry
KEYS: web.AppKey[Keys] = web.AppKey("keys", Keys)
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining", asyncio.Event)
COUNTERS: web.AppKey[Any] = web.AppKey("counters", object)
PRINCIPAL: web.RequestKey[Principal] = web.RequestKey("principal", Principal)


def error_response(e: RadixflowError) -> web.Response:
    headers = {}
    retry = getattr(e, "retry_after", None)
    if retry is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    return web.json_response(error_body(e), status=e.code, headers=headers)


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        resp = await handler(request)
    except RadixflowError as e:
        _count(request, e.code)
        return error_response(e)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(_http_error(e))
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:   # a bug: still JSON, still logged, never a bare 500 page
        _log.error("unhandled error", path=request.path, error=repr(e), exc_info=e)
        return web.json_response({"error": {"message": f"internal error: {type(e).__name__}",
                                            "type": "internal_error", "param": None, "code": 500}}, status=500)
    _count(request, resp.status)
    return resp


def _http_error(e: web.HTTPException) -> RadixflowError:
    err = RadixflowError(e.reason or "error")
    err.code, err.kind = e.status, "not_found_error" if e.status == 404 else "invalid_request_error"
    return err


def _count(request: web.Request, status: int) -> None:
    """Per-tenant HTTP counters (tenant "unknown" until a key names one)."""
    who: Principal | None = request.get(PRINCIPAL)
    request.app[COUNTERS][(who.tenant if who else "unknown", str(status))] += 1


def principal(request: web.Request) -> Principal:
    """Who is calling (a 401 without a valid key when auth is on)."""
    who = request.get(PRINCIPAL)
    if who is None:
        who = request[PRINCIPAL] = request.app[KEYS].principal(request.headers.get("Authorization", ""))
    return who


def request_for(request: web.Request, who: Principal, req: GenerateRequest | ProgramRequest) -> None:
    """Stamp the caller onto a request: tenant, its cache scope, the forced salt, its limits."""
    req.tenant, req.cache_scope, req.limits = who.tenant, who.scope, who.limits
    req.cache_salt = who.salt(req.cache_salt)


def check_open(request: web.Request) -> None:
    if request.app[DRAINING].is_set():
        raise ServiceUnavailable("the server is shutting down")


def check_model(request: web.Request, model: str) -> str:
    """The served model a request names. With one model served, any name is taken to mean it (as
    SGLang does: clients written for other servers send their own model names); with several, an
    unknown name is a 404."""
    return resolve_model(sorted({m.model for m in request.app[CLIENT].models()}), model)


def resolve_model(served: list[str], model: str) -> str:
    if not served:
        raise ServiceUnavailable("no executor is available")
    if model in served or len(served) == 1:
        return model if model in served else served[0]
    raise NotFound(f"the model {model!r} does not exist; served: {', '.join(served)}", param="model")


def tenant_samples(app: web.Application) -> list[Sample]:
    return [Sample(name="http_requests_total", value=v, labels={"tenant": t, "status": s})
            for (t, s), v in sorted(app[COUNTERS].items())]


def secret(value: str, path: str) -> str:
    """A secret given in the environment (value) or in a file (its first line)."""
    if path:
        with open(path) as f:
            value = f.readline().strip()
        if not value:
            raise ValueError(f"{path} is empty")
    return value


def make_app(bus: Bus, client: EngineClient, config: Any) -> web.Application:
    # a body larger than one bus message could not be submitted anyway: refused before it is read
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[BUS], app[CLIENT], app[CONFIG], app[DRAINING] = bus, client, config, asyncio.Event()
    app[KEYS] = Keys.load(getattr(config, "auth_file", ""), tuple(config.api_keys))
    app[SCRAPE_TOKEN] = secret(getattr(config, "metrics_token", ""), getattr(config, "metrics_token_file", ""))
    app[COUNTERS] = defaultdict(int)
    from . import native, openai, ops, programs     # the dialects build on this module's helpers
    openai.add_routes(app)
    native.add_routes(app)
    programs.add_routes(app)
    ops.add_routes(app)
    return app
