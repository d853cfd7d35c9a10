"""The HTTP surface (aiohttp): SGLang-native /generate, OpenAI /v1/completions and
/v1/chat/completions (both with SSE streaming), /v1/models, /health.

Errors always come back as JSON in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from radixflow.shared import log, subjects
from radixflow.shared.bus import Bus
from radixflow.shared.errors import BadRequest, NotFound, RadixflowError, ServiceUnavailable, Unauthorized
from radixflow.shared.messages import (Accepted, GenerateRequest, MemoryReply, MetricsReply, RadixFlush, RadixFlushed,
                                       StatusReply, StatusRequest, StreamChunk)
from radixflow.shared.validate import check_request

from . import protocol as P
from .client import EngineClient, Result, new_rid

_log = log.get("gateway")
CLIENT: web.AppKey[EngineClient] = web.AppKey("client", EngineClient)
BUS: web.AppKey[Bus] = web.AppKey("bus", Bus)
CONFIG: web.AppKey[Any] = web.AppKey("config", object)
DRAINING: web.AppKey[asyncio.Event] = web.AppKey("draining", asyncio.Event)


def error_response(e: RadixflowError) -> web.Response:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    return web.json_response(body, status=e.code)


@web.middleware
async def errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except RadixflowError as e:
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


def _http_error(e: web.HTTPException) -> RadixflowError:
    err = RadixflowError(e.reason or "error")
    err.code, err.kind = e.status, "not_found_error" if e.status == 404 else "invalid_request_error"
    return err


def _tenant(request: web.Request) -> str:
    keys: tuple[str, ...] = request.app[CONFIG].api_keys
    if not keys:
        return "default"
    auth = request.headers.get("Authorization", "")
    token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    for k in keys:
        key, _, tenant = k.partition(":")
        if token == key:
            return tenant or key
    raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")


def _check_open(request: web.Request) -> None:
    if request.app[DRAINING].is_set():
        raise ServiceUnavailable("the server is shutting down")


def _check_model(request: web.Request, model: str) -> None:
    models = request.app[CLIENT].models()
    if not models:
        raise ServiceUnavailable("no executor is available")
    if model not in {m.model for m in models}:
        raise NotFound(f"the model {model!r} does not exist; served: {', '.join(m.model for m in models)}", param="model")


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()) + b"\n\n")


async def _stream_error(resp: web.StreamResponse, e: RadixflowError) -> None:
    await _send(resp, {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}})


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------- SGLang-native


def _finish_native(reason: str | None, matched, completion: int) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion}
    return {"type": reason, "matched": matched}


async def generate(request: web.Request) -> web.StreamResponse:
    _check_open(request)
    tenant = _tenant(request)
    body: P.GenerateBody = P.decode_body(await request.read(), P.GenerateBody)
    if body.return_logprob:
        raise BadRequest("return_logprob is not supported", param="return_logprob")
    req = GenerateRequest(rid=body.rid or new_rid(), stream_subject="", text=body.text, input_ids=body.input_ids,
                          sampling=P.native_sampling(body.sampling_params), tenant=tenant, cache_salt=body.cache_salt,
                          stream=body.stream, constraint=P.native_constraint(body.sampling_params))
    check_request(req)
    with log.bind_request(req.rid):
        return await _generate(request, req, body)


async def _generate(request: web.Request, req: GenerateRequest, body: P.GenerateBody) -> web.StreamResponse:
    client = request.app[CLIENT]
    t0 = time.monotonic()
    if not body.stream:
        r = await client.complete(req)
        return web.json_response(_native_body(r, time.monotonic() - t0))
    gen = client.generate(req)
    try:
        acc = await gen.__anext__()
        resp = await _sse(request)
        r = Result(rid=req.rid, prompt_tokens=acc.prompt_tokens)
        try:
            async for item in gen:
                _accumulate(r, item)
                await _send(resp, _native_body(r, time.monotonic() - t0))
        except RadixflowError as e:
            await _stream_error(resp, e)
        await _send(resp, b"[DONE]")
        return resp
    finally:
        await gen.aclose()


def _accumulate(r: Result, item: StreamChunk) -> None:
    r.text += item.text
    r.output_ids.extend(item.token_ids)
    if item.finished:
        r.finish_reason, r.matched_stop = item.finish_reason, item.matched_stop
        r.cached_tokens = item.usage.cached_tokens if item.usage else 0


def _native_body(r: Result, latency: float) -> dict:
    return {"text": r.text, "output_ids": r.output_ids, "meta_info": {
        "id": r.rid, "prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.output_ids),
        "cached_tokens": r.cached_tokens, "finish_reason": _finish_native(r.finish_reason, r.matched_stop, len(r.output_ids)),
        "e2e_latency": round(latency, 6)}}


# ---------------------------------------------------------------- OpenAI


def _oa_reason(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


async def completions(request: web.Request) -> web.StreamResponse:
    _check_open(request)
    tenant = _tenant(request)
    body: P.CompletionBody = P.decode_body(await request.read(), P.CompletionBody)
    P.completion_checks(body)
    _check_model(request, body.model)
    prompt = body.prompt
    req = GenerateRequest(rid=new_rid(), stream_subject="", tenant=tenant, cache_salt=body.cache_salt,
                          text=prompt if isinstance(prompt, str) else None,
                          input_ids=prompt if isinstance(prompt, list) else None,
                          sampling=P.openai_sampling(body, body.max_tokens, 16), stream=body.stream,
                          constraint=P.openai_constraint(body))
    check_request(req)
    with log.bind_request(req.rid):
        return await _openai(request, req, body, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    _check_open(request)
    tenant = _tenant(request)
    body: P.ChatBody = P.decode_body(await request.read(), P.ChatBody)
    _check_model(request, body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    req = GenerateRequest(rid=new_rid(), stream_subject="", tenant=tenant, cache_salt=body.cache_salt,
                          messages=P.chat_messages(body), sampling=P.openai_sampling(body, max_tokens, 1024),
                          stream=body.stream, constraint=P.openai_constraint(body))
    check_request(req)
    with log.bind_request(req.rid):
        return await _openai(request, req, body, chat=True)


async def _openai(request: web.Request, req: GenerateRequest, body: P._OpenAIBase, chat: bool) -> web.StreamResponse:
    client = request.app[CLIENT]
    oid = ("chatcmpl-" if chat else "cmpl-") + req.rid
    created = int(time.time())
    head = {"id": oid, "object": "chat.completion" if chat else "text_completion", "created": created, "model": body.model}
    if not body.stream:
        r = await client.complete(req)
        choice = {"index": 0, "logprobs": None, "finish_reason": _oa_reason(r.finish_reason)}
        if chat:
            choice["message"] = {"role": "assistant", "content": r.text}
        else:
            choice["text"] = r.text
        return web.json_response(head | {"choices": [choice],
                                         "usage": _usage(r.prompt_tokens, len(r.output_ids), r.cached_tokens)})
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = client.generate(req)
    try:
        acc: Accepted = await gen.__anext__()
        resp = await _sse(request)
        if chat:
            await _send(resp, head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]})
        r = Result(rid=req.rid, prompt_tokens=acc.prompt_tokens)
        try:
            async for item in gen:
                _accumulate(r, item)
                reason = _oa_reason(item.finish_reason) if item.finished else None
                if not item.text and reason is None:
                    continue
                if chat:
                    delta = {"content": item.text} if item.text else {}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": item.text, "logprobs": None, "finish_reason": reason}
                await _send(resp, head | {"choices": [choice]})
            if include_usage:
                await _send(resp, head | {"choices": [], "usage": _usage(r.prompt_tokens, len(r.output_ids), r.cached_tokens)})
        except RadixflowError as e:
            await _stream_error(resp, e)
        await _send(resp, b"[DONE]")
        return resp
    finally:
        await gen.aclose()


async def models(request: web.Request) -> web.Response:
    _tenant(request)
    data = [{"id": m.model, "object": "model", "created": 0, "owned_by": "radixflow", "max_model_len": m.max_model_len}
            for m in request.app[CLIENT].models()]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """200 only when every service answers its status request and an executor is serving a model
    (known to both the scheduler and this gateway, so a request sent now can run)."""
    bus, cfg = request.app[BUS], request.app[CONFIG]

    async def ask(service: str) -> StatusReply | None:
        try:
            return await bus.request(subjects.status(service), StatusRequest(), StatusReply, timeout=cfg.health_timeout_s)
        except RadixflowError:
            return None
    names = [s for s in subjects.SERVICES if s != "gateway"]
    replies = dict(zip(names, await asyncio.gather(*(ask(s) for s in names))))
    ok = {n: r is not None for n, r in replies.items()}
    ok["scheduler"] = ok["scheduler"] and bool(replies["scheduler"].detail.get("executors"))
    ok["executor"] = ok["executor"] and bool(request.app[CLIENT].models())
    ok["gateway"] = not request.app[DRAINING].is_set()
    healthy = all(ok.values())
    return web.json_response({"status": "ok" if healthy else "unavailable", "services": ok}, status=200 if healthy else 503)


async def flush_cache(request: web.Request) -> web.Response:
    """Empty every unlocked KV page of every pool (what running requests hold stays)."""
    _tenant(request)
    out = await request.app[BUS].request(subjects.RADIX_FLUSH, RadixFlush(), RadixFlushed, timeout=10)
    return web.json_response({"message": "cache flushed", "freed_pages": out.freed_pages})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text: every instance's samples, gathered over the bus."""
    replies = await request.app[BUS].gather(subjects.METRICS, StatusRequest(), MetricsReply, window_s=0.2)
    by_name: dict[str, list[str]] = {}
    for r in sorted(replies, key=lambda r: (r.service, r.instance)):
        for s in r.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            by_name.setdefault(s.name, []).append(f"radixflow_{s.name}{{{labels}}} {s.value:g}")
    lines = []
    for name in sorted(by_name):
        lines.append(f"# TYPE radixflow_{name} {'counter' if name.endswith('_total') else 'gauge'}")
        lines.extend(by_name[name])
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def memory(request: web.Request) -> web.Response:
    """Realized memory of every executor (bytes per token, per state slot, dtypes, pool sizes) with
    its pool's occupancy as the radix service sees it."""
    _tenant(request)
    bus = request.app[BUS]
    reports = await bus.gather(subjects.MEMORY, StatusRequest(), MemoryReply, window_s=0.2)
    try:
        pools = (await bus.request(subjects.status("radix"), StatusRequest(), StatusReply, timeout=2)).detail.get("pools", {})
    except RadixflowError:
        pools = {}
    return web.json_response({"executors": [
        {"instance": r.instance, "model": r.model} | r.report | {"occupancy": pools.get(r.instance, {})}
        for r in sorted(reports, key=lambda r: r.instance)]})


def make_app(bus: Bus, client: EngineClient, config: Any) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=64 * 1024 * 1024)
    app[BUS], app[CLIENT], app[CONFIG], app[DRAINING] = bus, client, config, asyncio.Event()
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/memory", memory)
    from . import programs     # the programs dialect (it builds on this module's helpers)
    programs.add_routes(app)
    return app
