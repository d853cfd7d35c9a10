"""Grammar service: compiles structured-output constraints (JSON Schema, json_object, regex, EBNF,
choice) with xgrammar or llguidance (backends/; `backend` picks the deployment default, a request
may name one, `auto` lets compiler._auto choose) against the served model's tokenizer, caches
them, and hands the compiled blobs to executors.

    rf.grammar.compile  GrammarCompile -> GrammarCompiled   (key, cache_hit, compile_s, size, backend, enforcement)
    rf.grammar.fetch    GrammarFetch   -> GrammarBlob       (the engine's zlib-compressed grammar, and the engine)

Deployment: run ONE grammar instance. The cache lives in its memory and a GrammarFetch carries
only a key (no spec to compile from), so with several instances in the `grammar` queue group a
fetch could land on an instance that never compiled that key and answer 404. Scale compile
throughput with the worker pool instead. A 404 on fetch (also possible after an LRU eviction
between compile and fetch) is answered by compiling again, which is idempotent and, for a
grammar still cached, microseconds; then fetch again.

A compiled blob must fit one NATS message: blobs over the server's max_payload are refused at
compile time with a 400 (raise max_payload for very large schemas).
"""
from __future__ import annotations

from importlib.metadata import version

from radixflow.shared import subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import ServiceConfig
from radixflow.shared.errors import BadRequest, NotFound
from radixflow.shared.messages import GrammarBlob, GrammarCompile, GrammarCompiled, GrammarFetch, Sample

from .compiler import Compiler

# room for the GrammarBlob envelope (key, msgpack framing) on top of the bus's own header allowance
_BLOB_HEADROOM = 4096


class GrammarService(Actor):
    service = "grammar"

    def __init__(self, bus: Bus, model_path: str, service_config: ServiceConfig | None = None,
                 instance: str | None = None, deadline_s: float = 10.0, cache_bytes: int = 256 << 20,
                 workers: int = 2, backend: str = "auto"):
        super().__init__(bus, service_config, instance)
        self.model_path = model_path
        self.compiler = Compiler(model_path, deadline_s=deadline_s, cache_bytes=cache_bytes, workers=workers,
                                 backend=backend)
        self.route(subjects.GRAMMAR_COMPILE, GrammarCompile, self.compile, queue="grammar")
        self.route(subjects.GRAMMAR_FETCH, GrammarFetch, self.fetch, queue="grammar")

    async def on_start(self) -> None:
        limit = self.bus.max_payload - _BLOB_HEADROOM
        self.compiler.max_blob_bytes = min(self.compiler.max_blob_bytes, limit)
        # workers come up in the background (seconds each, in parallel with the other services'
        # startup); a compile that arrives first waits for one
        await self.compiler.start(wait_workers=False)
        self.log.info("grammar compiler starting", workers=self.compiler.n_workers, backend=self.compiler.backend,
                      tokenizer=self.compiler.identity, max_blob_bytes=self.compiler.max_blob_bytes)

    async def on_stop(self) -> None:
        await self.compiler.stop()

    async def compile(self, req: GrammarCompile) -> GrammarCompiled:
        if req.tokenizer and req.tokenizer != self.compiler.identity:
            raise BadRequest(f"this grammar service compiles for tokenizer {self.compiler.identity!r}, "
                             f"not {req.tokenizer!r}", param="tokenizer")
        r = await self.compiler.compile(req.kind, req.spec, req.backend)
        return GrammarCompiled(key=r.key, compile_s=r.compile_s, cache_hit=r.cache_hit, size=r.size,
                               backend=r.backend, enforcement=r.enforcement)

    async def fetch(self, req: GrammarFetch) -> GrammarBlob:
        entry = self.compiler.fetch(req.key)
        if entry is None and req.source is not None:
            # compiled elsewhere (another instance, or this one before a restart): compile it here
            s = req.source
            r = await self.compiler.compile(s.kind, s.spec, s.backend)
            if r.key != req.key:
                raise NotFound(f"the grammar compiles to another key on this instance ({r.key[:16]}... for "
                               f"{req.key[:16]}...): a different tokenizer or engine version", param="key")
            entry = self.compiler.fetch(r.key)
        if entry is None:
            raise NotFound(f"no compiled grammar with key {req.key[:16]}... on this grammar instance "
                           "(evicted, or compiled elsewhere); compile it again, then fetch", param="key")
        return GrammarBlob(key=req.key, data=entry.data, backend=entry.backend)

    def status(self) -> dict:
        return {"xgrammar": version("xgrammar"), "llguidance": version("llguidance"), "tokenizer": self.compiler.identity, **self.compiler.stats()}

    def metrics(self) -> list[Sample]:
        c, cache = self.compiler, self.compiler.cache
        return [
            Sample(name="grammar_cache_hits_total", value=cache.hits),
            Sample(name="grammar_cache_misses_total", value=cache.misses),
            Sample(name="grammar_cache_evictions_total", value=cache.evictions),
            Sample(name="grammar_cache_bytes", value=cache.bytes),
            Sample(name="grammar_cache_entries", value=len(cache)),
            Sample(name="grammar_compiles_total", value=c.compiles),
            Sample(name="grammar_compile_failures_total", value=c.failures),
            Sample(name="grammar_compile_timeouts_total", value=c.timeouts),
            Sample(name="grammar_workers_alive", value=c.workers_alive),
            *c.compile_seconds.samples(),
        ]
