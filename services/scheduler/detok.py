"""Detokenization of each step's outputs: in this process when the model's tokenizer is readable
here, else by a round trip to the tokenizer service.

Every output step of every streaming request is detokenized, so a round trip per step sits on every
token's way to the client (encode, request, the tokenizer's loop, reply, decode). Where the
scheduler shares a host and a filesystem with the model (`radixflow up`, or compose with the model
volume mounted), it loads the same tokenizer and decodes locally. The tokenizer service stays the
authority: its info names the model directory and the tokenizer's identity, and a local copy is used
only if it loads from that path with the same identity. Until it has loaded (in a thread, in the
background), and wherever it cannot, outputs go the remote way.
"""
from __future__ import annotations

import asyncio
import os

from radixflow.shared import log, subjects
from radixflow.shared.errors import RequestTimeout, ServiceUnavailable
from radixflow.shared.messages import DetokenizeReply, DetokenizeRequest, DetokItem, DetokResult, TokenizerInfo

_log = log.get("scheduler")


def _load_tokenizer(path: str):
    # the import too belongs in the thread: transformers takes seconds to import, and on the event
    # loop it silenced the scheduler long enough to declare every executor dead
    from radixflow.services.tokenizer.tokenizer import Tokenizer
    return Tokenizer(path)


class Detokenizer:
    def __init__(self, bus, enabled: bool = True):
        self.bus = bus
        self.enabled = enabled
        self.local = None                 # a loaded Tokenizer with the service's identity
        self._loading: asyncio.Task | None = None

    def offer(self, info: TokenizerInfo) -> None:
        """The tokenizer service's info: start loading a local copy if its directory is here."""
        if not self.enabled or self._loading is not None or not info.path or not os.path.isdir(info.path):
            return
        self._loading = asyncio.get_running_loop().create_task(self._load(info))

    async def _load(self, info: TokenizerInfo) -> None:
        try:
            tok = await asyncio.get_running_loop().run_in_executor(None, _load_tokenizer, info.path)
        except Exception as e:            # unreadable here after all: stay remote
            _log.info("detokenizing remotely", reason=f"{type(e).__name__}: {e}"[:200])
            return
        if tok.identity != info.identity:
            _log.info("detokenizing remotely", reason="the local tokenizer differs from the service's")
            return
        self.local = tok
        _log.info("detokenizing in process", path=info.path)

    async def run(self, items: list[DetokItem]) -> list[DetokResult]:
        if self.local is None:
            try:
                # sent again after 2 s without an answer: a tokenizer killed or draining as it
                # took the request never answers, and another instance (or its restart) will
                reply = await self.bus.request(subjects.TOKENIZER_DETOKENIZE, DetokenizeRequest(items=items),
                                               DetokenizeReply, timeout=10, idempotent=True, attempt_s=2)
                return reply.items
            except (ServiceUnavailable, RequestTimeout):
                # no tokenizer service (one restarting): the local copy, if it is on its way
                if self._loading is None:
                    raise
                await asyncio.wait_for(asyncio.shield(self._loading), 30)
                if self.local is None:
                    raise
        from radixflow.services.tokenizer.service import detokenize_items   # loaded with the tokenizer
        return detokenize_items(self.local, items)
