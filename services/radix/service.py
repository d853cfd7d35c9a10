"""Radix service: the single authority over the KV pages and state slots of every executor pool.
A thin shell around one PagePool per executor (pool.py); an executor registers its pool, then
sends one RadixStep per scheduling step. Pools of executors that stop beating are dropped.

Run exactly one radix instance: the pools are its state. A restarted instance knows no pool: each
executor's next step gets NotFound, and the executor registers again with what its running
requests hold (RadixRegister.held), so they go on; only the cached prefixes are lost."""
from __future__ import annotations

import asyncio
import time

from radixflow.shared import subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import ServiceConfig
from radixflow.shared.errors import BadRequest, NotFound
from radixflow.shared.messages import (Heartbeat, RadixAdopt, RadixFlush, RadixFlushed, RadixPlace, RadixPlaceReply, RadixRegister,
                                       RadixRegistered, RadixStep, RadixStepReply, Sample)

from .pool import PagePool

POOL_TIMEOUT_S = 10.0     # an executor silent this long is gone; its pool with it


class RadixService(Actor):
    service = "radix"

    def __init__(self, bus: Bus, service_config: ServiceConfig | None = None, instance: str | None = None):
        super().__init__(bus, service_config, instance)
        self.pools: dict[str, PagePool] = {}
        self.seen: dict[str, float] = {}
        self.route(subjects.RADIX_REGISTER, RadixRegister, self.register)
        self.route(subjects.RADIX_ADOPT, RadixAdopt, self.adopt)
        self.route(subjects.radix_step("*"), RadixStep, self.step)
        self.route(subjects.RADIX_FLUSH, RadixFlush, self.flush)
        self.route(subjects.RADIX_PLACE, RadixPlace, self.place)
        self.route(subjects.heartbeat("executor"), Heartbeat, self.on_executor)

    async def on_start(self) -> None:
        self.spawn("reaper", self._reap)

    async def register(self, req: RadixRegister) -> RadixRegistered:
        if req.num_pages <= 0 or req.page_size <= 0:
            raise BadRequest("num_pages and page_size must be positive")
        pool = PagePool(req.num_pages, req.page_size, req.cache, req.num_state_slots, req.checkpoint_interval,
                        req.tier_root, req.tier_load_pages)
        pool.adopt(req.held)
        self.pools[req.pool] = pool
        self.seen[req.pool] = time.monotonic()
        self.log.info("pool registered", pool=req.pool, pages=req.num_pages, page_size=req.page_size, cache=req.cache,
                      state_slots=req.num_state_slots, adopted_requests=len(req.held))
        return RadixRegistered(pool=req.pool, known_candidates=True)

    async def adopt(self, req: RadixAdopt) -> RadixRegistered:
        pool = self.pools.get(req.pool)
        if pool is None:
            raise NotFound(f"unknown pool {req.pool!r}: register first")
        pool.adopt(req.held)
        self.log.info("pool adopted more", pool=req.pool, adopted_requests=len(req.held))
        return RadixRegistered(pool=req.pool)

    async def step(self, req: RadixStep) -> RadixStepReply:
        pool = self.pools.get(req.pool)
        if pool is None:
            raise NotFound(f"unknown pool {req.pool!r}: register first")
        self.seen[req.pool] = time.monotonic()
        return pool.step(req)

    async def flush(self, req: RadixFlush) -> RadixFlushed:
        names = list(self.pools) if req.pool is None else [req.pool]
        return RadixFlushed(freed_pages=sum(self.pools[n].flush(req.scopes, req.namespaces) for n in names if n in self.pools))

    async def place(self, req: RadixPlace) -> RadixPlaceReply:
        chains: dict = {}          # the prompt's page keys, once per model among the pools
        found = {p: self.pools[p].placement(req.namespace, req.token_ids, chains) for p in req.pools if p in self.pools}
        return RadixPlaceReply(cached_tokens={p: dev + tier for p, (dev, tier) in found.items()},
                               tier_tokens={p: tier for p, (_, tier) in found.items() if tier})

    async def on_executor(self, hb: Heartbeat) -> None:
        if hb.instance in self.pools:
            self.seen[hb.instance] = time.monotonic()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for name, pool in self.pools.items():
                expired = pool.expire_pins(now)
                if expired:
                    self.log.warning("pins expired before their program unpinned them", pool=name, pins=len(expired))
            if not self.bus.settled(POOL_TIMEOUT_S):
                continue     # cut off from NATS ourselves: the beats we missed say nothing
            for p in [p for p, t in self.seen.items() if now - t > POOL_TIMEOUT_S]:
                self.pools.pop(p, None)
                self.seen.pop(p, None)
                self.log.warning("pool dropped: its executor stopped beating", pool=p)

    def status(self) -> dict:
        return {"pools": {name: pool.stats() for name, pool in self.pools.items()}}

    def heartbeat_detail(self) -> dict:
        # the pools held: an executor whose pool was dropped (its beats late, as under a loaded
        # start) registers again when it hears it is not among them, idle or not
        return {"pools": sorted(self.pools)}

    def metrics(self) -> list[Sample]:
        out = []
        for name, pool in self.pools.items():
            st = pool.stats()
            for key in ("kv_pages_used", "kv_pages_total", "kv_pages_evictable", "kv_pages_cached", "kv_pages_pinned",
                        "pins", "evicted_pages_total",
                        "state_slots_used", "state_slots_total", "state_slots_cached", "state_checkpoints_total",
                        "state_restores_total", "state_recomputed_tokens_total", "evicted_states_total",
                        "quota_evicted_pages_total", "tier_pages_known", "tier_states_known"):
                if key in st:
                    out.append(Sample(name=key, value=st[key], labels={"pool": name}))
            out += [Sample(name="scope_kv_pages_cached", value=v, labels={"pool": name, "scope": scope})
                    for scope, v in sorted(pool.cached_by_scope().items())]
        return out
