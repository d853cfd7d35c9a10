"""GrammarStore: the executor's local cache of compiled grammars, fetched by key from the grammar
service once and loaded by the engine that compiled them (GrammarBlob.backend) against this
executor's own tokenizer state, so a hot schema costs neither a compile nor a transfer per request."""
from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict

from radixflow.services.grammar.backends.base import Backend, Grammar
from radixflow.shared import subjects
from radixflow.shared.bus import Bus
from radixflow.shared.errors import RadixflowError
from radixflow.shared.messages import GrammarBlob, GrammarCompile, GrammarFetch


class GrammarStore:
    def __init__(self, bus: Bus, backends: dict[str, Backend], unavailable: dict[str, str] | None = None,
                 capacity: int = 256):
        self.bus = bus
        self.backends = backends
        self.unavailable = unavailable or {}   # engine -> why it cannot serve this model
        self.capacity = capacity
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._inflight: dict[str, asyncio.Future] = {}
        self.fetches = 0
        self.hits = 0

    async def get(self, key: str, source: GrammarCompile | None = None) -> Grammar:
        g = self._cache.get(key)
        if g is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return g
        fut = self._inflight.get(key)
        if fut is None:               # one fetch per key, however many requests wait for it
            fut = self._inflight[key] = asyncio.ensure_future(self._fetch(key, source))
            fut.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(fut)

    async def _fetch(self, key: str, source: GrammarCompile | None) -> Grammar:
        # a fetch may compile (an instance that does not hold the key): attempts of 5 s, so one
        # lost with a dying instance is sent again to another, not waited on for the whole timeout
        blob = await self.bus.request(subjects.GRAMMAR_FETCH, GrammarFetch(key=key, source=source), GrammarBlob,
                                      timeout=30, idempotent=True, attempt_s=5)
        self.fetches += 1
        backend = self.backends.get(blob.backend)
        if backend is None:
            why = self.unavailable.get(blob.backend, "unknown engine")
            raise RadixflowError(f"this executor cannot load {blob.backend} grammars: {why}")
        raw = zlib.decompress(blob.data)
        g = await asyncio.get_running_loop().run_in_executor(None, backend.load, raw)
        self._cache[key] = g
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return g
