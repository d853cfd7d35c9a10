"""Server-sent events, the one way every dialect streams: `data: <json>` events, then `data: [DONE]`.
An error after the stream has started is an event in OpenAI's error shape (the status is already 200)."""
from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from radixflow.shared.errors import RadixflowError


def error_body(e: RadixflowError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


_encode = msgspec.json.Encoder().encode


class SSE:
    def __init__(self, resp: web.StreamResponse):
        self.resp = resp

    @classmethod
    async def open(cls, request: web.Request, headers: dict[str, str] | None = None) -> "SSE":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                                  | (headers or {}))
        await resp.prepare(request)
        return cls(resp)

    async def send(self, obj: Any) -> None:
        # msgspec: far cheaper than json.dumps, on every event of every stream (and a non-finite
        # float becomes null, valid JSON, where json.dumps wrote NaN)
        data = obj if isinstance(obj, bytes) else _encode(obj)
        await self.resp.write(b"data: " + data + b"\n\n")

    async def error(self, e: RadixflowError) -> None:
        await self.send(error_body(e))

    async def done(self) -> web.StreamResponse:
        await self.send(b"[DONE]")
        return self.resp
