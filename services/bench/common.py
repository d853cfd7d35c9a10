"""Helpers shared by the benchmarks: resolve a model, run the whole service stack in-process on an
embedded nats-server, talk HTTP to it."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from contextlib import asynccontextmanager

import aiohttp

from radixflow.services.stack import Stack, stack_config
from radixflow.shared.natsd import NatsServer

PRESETS = ("tiny-dense", "tiny-hybrid")


def resolve_model(name: str) -> str:
    """A preset name (created in the cache on first use) or a model directory."""
    if name in PRESETS:
        from radixflow.services.cli.main import _cache_dir
        from radixflow.services.modelgen.make import make_model
        path = os.path.join(_cache_dir(), "models", name)
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            make_model(name, path)
        return path
    return name


@asynccontextmanager
async def served(model: str, **overrides):
    """The full service path (HTTP -> gateway -> NATS -> ... -> executor) in this process."""
    with NatsServer() as nats:
        stack = await Stack(stack_config(nats.url, model, gw_port=0, **overrides)).start()
        base = f"http://127.0.0.1:{stack.actors['gateway'].port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
            for _ in range(200):
                async with http.get(base + "/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
            try:
                yield stack, http, base
            finally:
                await stack.stop()


async def generate(http: aiohttp.ClientSession, base: str, body: dict) -> dict:
    async with http.post(base + "/generate", data=json.dumps(body)) as r:
        out = await r.json()
        if r.status != 200:
            raise RuntimeError(f"/generate {r.status}: {out}")
        return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Timer:
    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
