"""Radix service: will own the radix trees and the page / state-slot allocators of every executor
pool (the radix issue). Today it tracks the executor pools it would serve and answers status; the
message contracts (RadixMatch, RadixPlace) are defined in shared/messages.py."""
from __future__ import annotations

import time

from radixflow.shared import subjects
from radixflow.shared.actor import Actor
from radixflow.shared.bus import Bus
from radixflow.shared.config import ServiceConfig
from radixflow.shared.messages import Heartbeat


class RadixService(Actor):
    service = "radix"

    def __init__(self, bus: Bus, service_config: ServiceConfig | None = None, instance: str | None = None):
        super().__init__(bus, service_config, instance)
        self.pools: dict[str, float] = {}
        self.route(subjects.heartbeat("executor"), Heartbeat, self.on_executor)

    async def on_executor(self, hb: Heartbeat) -> None:
        self.pools[hb.instance] = time.monotonic()

    def status(self) -> dict:
        now = time.monotonic()
        return {"pools": sorted(p for p, t in self.pools.items() if now - t < 5.0)}
