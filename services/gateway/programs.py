"""The programs API (HTTP dialect): POST /v1/programs, GET /v1/programs/{id},
DELETE /v1/programs/{id}, DELETE /v1/programs/{id}/nodes/{node}.

    POST {"nodes": [...], "stream": false}
      -> {"id", "state", "nodes": {NODE: {"state", "text", "output", "meta_info": {...}, "error"?}}}
    with "stream": true, SSE events: started / delta / finished (and discarded: a speculative branch
    that lost a select) per node, then one "done" event
    carrying the whole result, then [DONE].
"""
from __future__ import annotations

from aiohttp import web

from radixflow.shared import log
from radixflow.shared.errors import RadixflowError
from radixflow.shared.messages import NodeResult, ProgramAccepted, ProgramEvent, ProgramQuery, ProgramRequest

from . import protocol as P
from .client import new_rid
from .native import finish_native
from .sse import SSE
from .state import check_open, gateway, principal, request_for


def node_json(r: NodeResult) -> dict:
    meta = {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "completion_tokens": r.completion_tokens,
            "finish_reason": finish_native(r.finish_reason, r.matched_stop, r.completion_tokens)}
    if r.kind == "select":
        meta["scores"] = r.scores
    out = {"state": r.state, "kind": r.kind, "text": r.text, "output": r.output, "output_ids": r.output_ids,
           "meta_info": meta, "executor": r.executor}
    if r.discarded:
        out["discarded"] = True
    if r.error is not None:
        out["error"] = {"message": r.error, "code": r.error_code}
    return out


def _dag_json(info) -> dict:
    return {"id": info.id, "state": info.state, "nodes": [
        {"id": r.id, "parent": r.parent, "after": r.after, "speculative": r.speculative} | node_json(r)
        for r in info.nodes]}


async def post_program(request: web.Request) -> web.StreamResponse:
    check_open(request)
    who = principal(request)
    body: P.ProgramBody = P.decode_body(await request.read(), P.ProgramBody)
    req = ProgramRequest(id=body.id or new_rid(), stream_subject="", nodes=body.nodes, cache_salt=body.cache_salt,
                         stream=body.stream, timeout_s=body.timeout)
    request_for(request, who, req)
    with log.bind_request(req.id):
        gen = gateway(request).client.program(req)
        try:
            acc: ProgramAccepted = await gen.__anext__()
            results: dict[str, dict] = {}
            state = "running"
            sse = await SSE.open(request) if body.stream else None
            try:
                async for ev in gen:
                    ev: ProgramEvent
                    if ev.kind in ("finished", "discarded") and ev.result is not None:
                        results[ev.node] = node_json(ev.result)
                    if ev.finished:
                        state = ev.status
                    if sse is None:
                        continue
                    if ev.kind == "started":
                        await sse.send({"event": "started", "id": acc.id, "node": ev.node})
                    elif ev.kind == "delta":
                        await sse.send({"event": "delta", "id": acc.id, "node": ev.node, "text": ev.text})
                    elif ev.kind in ("finished", "discarded"):
                        await sse.send({"event": ev.kind, "id": acc.id, "node": ev.node} | results[ev.node])
            except RadixflowError as e:
                if sse is None:
                    raise
                await sse.error(e)
                return await sse.done()
            out = {"id": acc.id, "state": state, "nodes": results}
            if sse is None:
                return web.json_response(out)
            await sse.send({"event": "done"} | out)
            return await sse.done()
        finally:
            await gen.aclose()


async def get_program(request: web.Request) -> web.Response:
    q = ProgramQuery(id=request.match_info["id"], tenant=principal(request).tenant)
    return web.json_response(_dag_json(await gateway(request).client.program_op("get", q)))


async def cancel_program(request: web.Request) -> web.Response:
    q = ProgramQuery(id=request.match_info["id"], tenant=principal(request).tenant, node=request.match_info.get("node"))
    return web.json_response(_dag_json(await gateway(request).client.program_op("cancel", q)))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/programs", post_program)
    app.router.add_get("/v1/programs/{id}", get_program)
    app.router.add_delete("/v1/programs/{id}", cancel_program)
    app.router.add_delete("/v1/programs/{id}/nodes/{node}", cancel_program)

