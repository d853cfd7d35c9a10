"""The HTTP surface (aiohttp), split by dialect:

    openai.py    /v1/completions, /v1/chat/completions, /v1/models
    native.py    SGLang's /generate, /tokenize, /detokenize, /get_model_info, /get_server_info, /health_generate
    programs.py  /v1/programs
    ops.py       /health, /metrics, /v1/memory, /flush_cache, /openapi.json

This module assembles them over one Gateway (state.py: the app's state, the caller's identity and
how it shapes a request) and holds the error middleware: errors are always JSON in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, and the answers it handles are counted per tenant.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from aiohttp import web

from radixflow.shared import log
from radixflow.shared.errors import RadixflowError

from . import native, openai, ops, programs
from .auth import Principal
from .sse import error_body
from .state import GATEWAY, PRINCIPAL, Gateway

_log = log.get("gateway")
MAX_BODY = 8 * 1024 * 1024      # the bus's max_payload (natsd.py): what one submission can carry


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
    request.app[GATEWAY].counters[(who.tenant if who else "unknown", str(status))] += 1


def make_app(gateway: Gateway) -> web.Application:
    # a body larger than one bus message could not be submitted anyway: refused before it is read
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    app[GATEWAY] = gateway
    openai.add_routes(app)
    native.add_routes(app)
    programs.add_routes(app)
    ops.add_routes(app)
    return app
