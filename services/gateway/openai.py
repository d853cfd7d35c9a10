"""The OpenAI dialect: /v1/completions, /v1/chat/completions (both with SSE streaming), /v1/models.

n completions share the prompt's pages (prefilled once, see scheduler/siblings.py); logprobs are
log_softmax of the model's raw logits; a completions batch (a list of prompts) answers with
choice index prompt * n + i, as OpenAI does.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from radixflow.shared import log
from radixflow.shared.errors import BadRequest, RadixflowError
from radixflow.shared.messages import Accepted, GenerateRequest, StreamChunk, TopLogprobs
from radixflow.shared.validate import check_batch, check_request

from . import protocol as P
from .client import Choice, Result, new_rid
from .sse import SSE
from .state import check_model, check_open, gateway, principal, request_for


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "length" if reason == "length" else "stop"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------- logprobs in OpenAI's two shapes


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def chat_logprobs(ids: list[int], lps: list[float], tops: list[TopLogprobs], k: int, texts: dict[int, str]) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        alts = tops[i] if i < len(tops) else TopLogprobs(ids=[], logprobs=[])
        content.append({"token": texts.get(t, ""), "logprob": lp, "bytes": _bytes(texts.get(t, "")),
                        "top_logprobs": [{"token": texts.get(a, ""), "logprob": alp, "bytes": _bytes(texts.get(a, ""))}
                                         for a, alp in list(zip(alts.ids, alts.logprobs))[:k]]})
    return {"content": content}


def completion_logprobs(ids: list[int], lps: list[float | None], tops: list[TopLogprobs | None], k: int,
                        texts: dict[int, str], offset: int = 0) -> dict:
    """tokens / token_logprobs / top_logprobs (a {text: logprob} dict per position) / text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, (t, lp) in enumerate(zip(ids, lps)):
        text = texts.get(t, "")
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        alts = tops[i] if i < len(tops) else None
        if lp is None or alts is None and k > 0:
            out["top_logprobs"].append(None)
        else:
            d = {texts.get(a, ""): alp for a, alp in (zip(alts.ids[:k], alts.logprobs[:k]) if alts else ())}
            d.setdefault(text, lp)      # the sampled token is always listed, as vLLM does
            out["top_logprobs"].append(d)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


# ---------------------------------------------------------------- /v1/completions


async def completions(request: web.Request) -> web.StreamResponse:
    check_open(request)
    who = principal(request)
    body: P.CompletionBody = P.decode_body(await request.read(), P.CompletionBody)
    P.completion_checks(body)
    model = check_model(request, body.model)
    prompts = P.prompts(body.prompt)
    if body.stream and len(prompts) > 1:
        raise BadRequest("stream with a list of prompts is not supported; send them one by one", param="stream")
    if body.stream and body.echo and body.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported with stream (the prompt's logprobs come at the end); "
                         "send it without stream", param="echo")
    want = body.logprobs is not None
    reqs = []
    for p in prompts:
        req = GenerateRequest(rid=new_rid(), stream_subject="", cache_salt=body.cache_salt,
                              text=p if isinstance(p, str) else None, input_ids=p if isinstance(p, list) else None,
                              sampling=P.openai_sampling(body, body.max_tokens, 16, logprobs=want, top=body.logprobs or 0,
                                                         defaults=gateway(request).client.sampling_defaults(model)),
                              stream=body.stream, constraint=P.openai_constraint(body), n=body.n,
                              logprob_start=0 if body.echo and want else -1)
        request_for(request, who, req)
        check_request(req)
        reqs.append(req)
    check_batch(reqs)
    if body.echo and body.n > 1 and any(r.sampling.max_new_tokens == 0 for r in reqs):
        raise BadRequest("n > 1 needs max_tokens > 0", param="n")
    with log.bind_request(reqs[0].rid):
        if body.stream:
            return await _stream(request, reqs[0], body, model, chat=False)
        results = await asyncio.gather(*(gateway(request).client.complete(r) for r in reqs), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        client = gateway(request).client
        ids = [t for r in results for c in r.choices for t in c.output_ids + [a for x in c.top_logprobs for a in x.ids]]
        ids += [t for r in results for t in r.input_ids + [a for x in r.input_top_logprobs for a in x.ids]]
        texts = await client.token_texts(ids) if want else {}
        echoes = [await _echo_text(request, p) if body.echo else "" for p in prompts]
        choices = []
        for pi, (r, echo) in enumerate(zip(results, echoes)):
            for c in r.choices:
                choice = {"index": pi * body.n + c.index, "text": echo + c.text, "logprobs": None,
                          "finish_reason": finish_reason(c.finish_reason)}
                if want:
                    k = body.logprobs or 0
                    if body.echo:
                        lps = [None] * (len(r.input_ids) - len(r.input_logprobs)) + list(r.input_logprobs)
                        tops = [None] * (len(r.input_ids) - len(r.input_top_logprobs)) + list(r.input_top_logprobs)
                        choice["logprobs"] = completion_logprobs(r.input_ids + c.output_ids, lps + c.logprobs,
                                                                 tops + c.top_logprobs, k, texts)
                    else:
                        choice["logprobs"] = completion_logprobs(c.output_ids, c.logprobs, c.top_logprobs, k, texts)
                choices.append(choice)
        return web.json_response(headers=results[0].headers(), data={
            "id": "cmpl-" + reqs[0].rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(sum(r.prompt_tokens for r in results),
                                              sum(r.completion_tokens for r in results),
                                              sum(r.cached_tokens for r in results))})


async def _echo_text(request: web.Request, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return await gateway(request).client.detokenize(prompt)      # whole: a character may span tokens


# ---------------------------------------------------------------- /v1/chat/completions


async def chat_completions(request: web.Request) -> web.StreamResponse:
    check_open(request)
    who = principal(request)
    body: P.ChatBody = P.decode_body(await request.read(), P.ChatBody)
    model = check_model(request, body.model)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    req = GenerateRequest(rid=new_rid(), stream_subject="", cache_salt=body.cache_salt,
                          messages=P.chat_messages(body), chat=P.chat_options(body, body.tool_choice),
                          sampling=P.openai_sampling(body, max_tokens, 1024, logprobs=body.logprobs,
                                                     top=body.top_logprobs or 0,
                                                     defaults=gateway(request).client.sampling_defaults(model)),
                          stream=body.stream, constraint=P.openai_constraint(body), n=body.n)
    request_for(request, who, req)
    check_request(req)
    if req.sampling.max_new_tokens == 0:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    with log.bind_request(req.rid):
        if body.stream:
            return await _stream(request, req, body, model, chat=True)
        r = await gateway(request).client.complete(req)
        texts = await _choice_texts(request, r.choices) if body.logprobs else {}
        choices = []
        for c in r.choices:
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs(c.output_ids, c.logprobs, c.top_logprobs, body.top_logprobs or 0,
                                                      texts) if body.logprobs else None,
                            "finish_reason": finish_reason(c.finish_reason)})
        return web.json_response(headers=r.headers(), data={
            "id": "chatcmpl-" + req.rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)})


async def _choice_texts(request: web.Request, choices: list[Choice] | list[StreamChunk]) -> dict[int, str]:
    ids = [t for c in choices for t in (c.output_ids if isinstance(c, Choice) else c.token_ids)]
    ids += [a for c in choices for x in c.top_logprobs for a in x.ids]
    return await gateway(request).client.token_texts(ids)


# ---------------------------------------------------------------- streaming (both)


async def _stream(request: web.Request, req: GenerateRequest, body: Any, model: str,
                  chat: bool) -> web.StreamResponse:
    client = gateway(request).client
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + req.rid,
            "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model}
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    want = body.logprobs if chat else body.logprobs is not None
    k = (body.top_logprobs or 0) if chat else (body.logprobs or 0)
    echo = "" if chat or not body.echo else await _echo_text(
        request, req.text if req.text is not None else req.input_ids)
    gen = client.generate(req)
    try:
        acc: Accepted = await gen.__anext__()
        r = Result(rid=req.rid)
        r.accepted(acc)
        sse = await SSE.open(request, r.headers())

        async def send(choice: dict) -> None:
            out = head | {"choices": [choice]}
            if continuous:
                out["usage"] = usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens)
            await sse.send(out)
        try:
            if chat:
                for i in range(req.n):
                    await send({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
            elif echo:
                for i in range(req.n):
                    await send({"index": i, "text": echo, "logprobs": None, "finish_reason": None})
            async for item in gen:
                r.add(item)
                reason = finish_reason(item.finish_reason)
                if not item.text and not item.token_ids and reason is None:
                    continue
                lp = None
                if want and item.token_ids:
                    texts = await _choice_texts(request, [item])
                    lp = (chat_logprobs if chat else completion_logprobs)(
                        item.token_ids, item.logprobs, item.top_logprobs, k, texts)
                if chat:
                    choice = {"index": item.index, "delta": {"content": item.text} if item.text else {},
                              "logprobs": lp, "finish_reason": reason}
                else:
                    choice = {"index": item.index, "text": item.text, "logprobs": lp, "finish_reason": reason}
                await send(choice)
            if include_usage:
                await sse.send(head | {"choices": [], "usage": usage(r.prompt_tokens, r.completion_tokens,
                                                                      r.cached_tokens)})
        except RadixflowError as e:
            await sse.error(e)
        return await sse.done()
    finally:
        await gen.aclose()


async def models(request: web.Request) -> web.Response:
    principal(request)
    data = [{"id": m.model, "object": "model", "created": 0, "owned_by": "radixflow", "max_model_len": m.max_model_len}
            for m in gateway(request).client.models()]
    return web.json_response({"object": "list", "data": data})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
