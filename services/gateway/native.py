"""The SGLang-native dialect: POST /generate (one prompt or a batch, streaming as SGLang does: every
event carries the cumulative text), /tokenize, /detokenize, /get_model_info, /get_server_info,
/health_generate, /abort_request.

    {"text": "..." | [...], "input_ids": [...] | [[...]], "sampling_params": {...} | [{...}],
     "return_logprob": bool, "logprob_start_len": int, "top_logprobs_num": int, "return_text_in_logprobs": bool}
      -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
          "cached_tokens", "e2e_latency", "input_token_logprobs", "output_token_logprobs",
          "input_top_logprobs", "output_top_logprobs"}}   (a list of those for a batch or n > 1)

Logprob entries are SGLang's [logprob, token_id, text or None]; the first prompt token has no
logprob (None), as in SGLang.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from radixflow.shared import log, subjects
from radixflow.shared.errors import BadRequest, RadixflowError
from radixflow.shared.messages import (AbortRequest, Accepted, DetokenizeReply, DetokenizeRequest, DetokItem, EncodeReply,
                                       EncodeRequest, GenerateRequest, SamplingParams, TopLogprobs)
from radixflow.shared.validate import MAX_RID, check_batch, check_request

from . import protocol as P
from .client import Choice, Result, new_rid
from .sse import SSE
from .state import Gateway, check_open, gateway, principal, request_for


def finish_native(reason: str | None, matched, completion: int) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion}
    return {"type": reason, "matched": matched}


def _per(v: Any, i: int, n: int, name: str) -> Any:
    """A field given once for the batch, or once per prompt."""
    if not isinstance(v, list):
        return v
    if len(v) != n:
        raise BadRequest(f"{name} has {len(v)} entries for {n} prompts", param=name)
    return v[i]


def requests_of(body: P.GenerateBody, defaults: dict[str, float] | None = None) -> list[tuple[GenerateRequest, dict]]:
    """One GenerateRequest per prompt, each with its logprob options (SGLang's batch form); `defaults`:
    the model's sampling defaults, for the fields a prompt's sampling_params leave unset."""
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("exactly one of text or input_ids is required", param="text")
    batch = isinstance(body.text, list) or bool(body.input_ids) and isinstance(body.input_ids[0], list)
    if body.text is not None:
        prompts: list[Any] = body.text if isinstance(body.text, list) else [body.text]
    else:
        prompts = [P.token_ids(p, "input_ids", "input_ids must be a list of token ids or a list of such lists")
                   for p in (body.input_ids if batch else [body.input_ids])]
    if not prompts:
        raise BadRequest("the batch is empty", param="text")
    if batch and body.stream:
        raise BadRequest("stream with a batch of prompts is not supported; send them one by one", param="stream")
    n = len(prompts)
    out = []
    for i, p in enumerate(prompts):
        want = bool(_per(body.return_logprob, i, n, "return_logprob"))
        start = _per(body.logprob_start_len, i, n, "logprob_start_len")
        top = _per(body.top_logprobs_num, i, n, "top_logprobs_num") if want else 0
        sp: P.NativeSampling = _per(body.sampling_params, i, n, "sampling_params")
        if isinstance(body.rid, str) and batch:
            rid = f"{body.rid}-{i}"                   # one id for a batch: one per prompt, as SGLang
        else:
            rid = _per(body.rid, i, n, "rid") if body.rid is not None else new_rid()
        req = GenerateRequest(rid=rid, stream_subject="", text=p if isinstance(p, str) else None,
                              input_ids=p if isinstance(p, list) else None,
                              sampling=P.native_sampling(sp, logprobs=want, top=top, defaults=defaults),
                              cache_salt=body.cache_salt,
                              stream=body.stream, constraint=P.native_constraint(sp), n=sp.n,
                              logprob_start=start if want else -1)
        out.append((req, {"logprob": want, "start": start, "top": top, "n": sp.n}))
    return out


async def generate(request: web.Request) -> web.StreamResponse:
    check_open(request)
    who = principal(request)
    body: P.GenerateBody = P.decode_body(await request.read(), P.GenerateBody)
    reqs = requests_of(body, gateway(request).client.sampling_defaults())
    check_batch([r for r, _ in reqs], "text")
    for req, _ in reqs:
        request_for(request, who, req)
        check_request(req)
    t0 = time.monotonic()
    if body.stream:
        req, opts = reqs[0]
        with log.bind_request(req.rid):
            return await _stream(request, req, opts, body.return_text_in_logprobs, t0)
    results = await asyncio.gather(*(gateway(request).client.complete(r) for r, _ in reqs), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    texts = await _texts(request, [(r, opts) for r, (_, opts) in zip(results, reqs)], body.return_text_in_logprobs)
    latency = time.monotonic() - t0
    out = [native_body(r, c, opts, texts, latency) for r, (_, opts) in zip(results, reqs) for c in r.choices]
    single = not isinstance(body.text, list) and not (body.input_ids and isinstance(body.input_ids[0], list))
    return web.json_response(out[0] if single and len(out) == 1 else out, headers=results[0].headers())


async def _stream(request: web.Request, req: GenerateRequest, opts: dict, with_text: bool, t0: float):
    client = gateway(request).client
    gen = client.generate(req)
    try:
        acc: Accepted = await gen.__anext__()
        r = Result(rid=req.rid)
        r.accepted(acc)
        sse = await SSE.open(request, r.headers())
        texts: dict[int, str] = {}        # token texts known so far: each event asks only for new ones
        try:
            async for item in gen:
                c = r.add(item)
                if opts["logprob"]:
                    texts = await _texts(request, [(r, opts)], with_text, texts)
                out = native_body(r, c, opts, texts, time.monotonic() - t0)
                if req.n > 1:
                    out["index"] = c.index
                await sse.send(out)
        except RadixflowError as e:
            await sse.error(e)
        return await sse.done()
    finally:
        await gen.aclose()


async def _texts(request: web.Request, results: list[tuple[Result, dict]], with_text: bool,
                 known: dict[int, str] | None = None) -> dict[int, str]:
    if not with_text:
        return {}
    ids: list[int] = []
    for r, opts in results:
        if not opts["logprob"]:
            continue
        ids += r.input_ids
        for tops in r.input_top_logprobs:
            ids += tops.ids
        for c in r.choices:
            ids += c.output_ids
            for tops in c.top_logprobs:
                ids += tops.ids
    return await gateway(request).client.token_texts(ids, known)


def _entry(lp: float | None, tok: int, texts: dict[int, str]) -> list:
    return [lp, tok, texts.get(tok)]


def _tops(t: TopLogprobs, texts: dict[int, str]) -> list[list]:
    return [_entry(lp, tok, texts) for tok, lp in zip(t.ids, t.logprobs)]


def native_body(r: Result, c: Choice, opts: dict, texts: dict[int, str], latency: float) -> dict:
    meta: dict[str, Any] = {
        "id": r.rid if opts.get("n", 1) == 1 else f"{r.rid}-{c.index}",
        "finish_reason": finish_native(c.finish_reason, c.matched_stop, len(c.output_ids)),
        "prompt_tokens": r.prompt_tokens, "completion_tokens": len(c.output_ids), "cached_tokens": r.cached_tokens,
        "e2e_latency": round(latency, 6)}
    if r.grammar_backend:
        meta["grammar"] = {"backend": r.grammar_backend, "enforcement": r.enforcement, "resamples": r.resamples,
                           "compile_s": round(r.grammar_compile_s, 6)}
    if opts["logprob"]:
        # As SGLang: the entry at logprob_start_len has no logprob (None), whatever the start (the
        # executor computes it when the start is past 0; it is dropped to answer as SGLang does).
        skip = len(r.input_ids) - len(r.input_logprobs)     # 1 at start 0 (the first token has no logprob)
        lps = [None] + list(r.input_logprobs[1 - skip:]) if r.input_ids else []
        meta["input_token_logprobs"] = [_entry(lp, t, texts) for lp, t in zip(lps, r.input_ids)]
        meta["output_token_logprobs"] = [_entry(lp, t, texts) for lp, t in zip(c.logprobs, c.output_ids)]
        if opts["top"] > 0:
            tops = r.input_top_logprobs[1 - skip:] if r.input_ids else []
            meta["input_top_logprobs"] = ([None] if r.input_ids else []) + [_tops(t, texts) for t in tops]
            meta["output_top_logprobs"] = [_tops(t, texts) for t in c.top_logprobs]
    return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}


# ---------------------------------------------------------------- tokens and information


MAX_ABORT = 1024


async def tokenize(request: web.Request) -> web.Response:
    principal(request)
    body: P.TokenizeBody = P.decode_body(await request.read(), P.TokenizeBody)
    text = body.text if body.text is not None else body.prompt
    bus = gateway(request).client.bus
    if body.messages is not None:
        msgs = P.chat_messages(P.ChatBody(model="", messages=body.messages))
        req = EncodeRequest(messages=msgs, chat=P.chat_options(body))
    elif isinstance(text, list):
        req = EncodeRequest(texts=text)
    elif text is not None:
        req = EncodeRequest(text=text)
    else:
        raise BadRequest("one of text, prompt or messages is required", param="text")
    reply: EncodeReply = await bus.request(subjects.TOKENIZER_ENCODE, req, EncodeReply, timeout=30, idempotent=True)
    limit = _max_model_len(request)
    if isinstance(text, list):
        return web.json_response({"tokens": reply.batch, "count": [len(b) for b in reply.batch], "max_model_len": limit})
    return web.json_response({"tokens": reply.input_ids, "count": len(reply.input_ids), "max_model_len": limit})


async def detokenize(request: web.Request) -> web.Response:
    principal(request)
    body: P.DetokenizeBody = P.decode_body(await request.read(), P.DetokenizeBody)
    if any(t < 0 for t in body.tokens):
        raise BadRequest("tokens must be non-negative token ids", param="tokens")
    reply = await gateway(request).client.bus.request(subjects.TOKENIZER_DETOKENIZE, DetokenizeRequest(items=[DetokItem(
        ids=body.tokens, prefix_offset=0, read_offset=0, skip_special_tokens=body.skip_special_tokens, flush=True)]),
        DetokenizeReply, timeout=10)
    return web.json_response({"text": reply.items[0].text})


def _max_model_len(request: web.Request) -> int:
    models = gateway(request).client.models()
    return models[0].max_model_len if models else 0


async def get_model_info(request: web.Request) -> web.Response:
    principal(request)
    models = gateway(request).client.models()
    name = models[0].model if models else ""
    return web.json_response({"model_path": name, "tokenizer_path": name, "is_generation": True,
                              "served_model_name": name, "max_model_len": _max_model_len(request),
                              "preferred_sampling_params": None, "weight_version": "default",
                              "has_image_understanding": False, "has_audio_understanding": False,
                              "model_type": None, "architectures": None})


async def get_server_info(request: web.Request) -> web.Response:
    principal(request)
    gw = gateway(request)
    cfg = gw.config
    from importlib.metadata import version as dist_version
    version = dist_version("radixflow")
    return web.json_response({"version": version, "served_model_names": [m.model for m in gw.client.models()],
                              "executors": [{"model": m.model, "max_model_len": m.max_model_len, "page_size": m.page_size,
                                             "vocab_size": m.vocab_size, "running": m.running, "waiting": m.waiting}
                                            for m in gw.client.models()],
                              "auth": bool(gw.keys),
                              "host": cfg.host, "port": cfg.port})


HEALTH_GENERATE_S = 10.0     # /health_generate: one generation per this long, whoever asks


async def health_generate(request: web.Request) -> web.Response:
    """200 once a one-token generation has gone through every service (SGLang's deep health check).
    It is open to probes, so it must not be a way to make the server generate: every caller within
    HEALTH_GENERATE_S of the last run gets that run's result, and concurrent callers share one run."""
    check_open(request)
    gw = gateway(request)
    state = gw.health
    now = time.monotonic()
    if state.get("task") is None and now - state.get("at", -1e9) > HEALTH_GENERATE_S:
        state["task"] = asyncio.ensure_future(_health_run(gw))
    if state.get("task") is not None:
        await asyncio.shield(state["task"])
    status, body = state.get("result", (503, {"status": "unavailable", "error": "the check was interrupted"}))
    return web.json_response(body | {"age_s": round(time.monotonic() - state.get("at", time.monotonic()), 3)},
                             status=status)


async def _health_run(gw: Gateway) -> None:
    state = gw.health
    models = gw.client.models()
    req = GenerateRequest(rid=new_rid(), stream_subject="", input_ids=[0], stream=False, tenant="!health",
                          sampling=SamplingParams(max_new_tokens=1, temperature=0))
    try:
        await asyncio.wait_for(gw.client.complete(req), timeout=20)
        state["result"] = 200, {"status": "ok", "model": models[0].model if models else None}
    except (RadixflowError, asyncio.TimeoutError) as e:
        msg = e.message if isinstance(e, RadixflowError) else "no answer within 20s"
        state["result"] = 503, {"status": "unavailable", "error": msg}
    finally:
        state["at"], state["task"] = time.monotonic(), None


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's POST /abort_request {"rid": ...}: abort the caller's own request of that id (ids are
    scoped by tenant: another tenant's request of the same id is not touched). 200 whether or not
    it was running, so that the answer says nothing about ids in use."""
    check_open(request)
    who = principal(request)
    body: P.AbortBody = P.decode_body(await request.read(), P.AbortBody)
    rids = [body.rid] if isinstance(body.rid, str) else body.rid
    if not rids or len(rids) > MAX_ABORT or not all(0 < len(r) <= MAX_RID for r in rids):
        raise BadRequest(f"rid must be a request id or a list of at most {MAX_ABORT} of them", param="rid")
    await gateway(request).client.bus.publish(subjects.SCHEDULER_ABORT, AbortRequest(rids=rids, tenant=who.tenant))
    return web.json_response({})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/server_info", get_server_info)      # what sglang.get_server_info() asks
    app.router.add_get("/health_generate", health_generate)
    app.router.add_post("/abort_request", abort_request)
