"""Whole stacks for integration tests: every service in this process, on a nats-server of its own
(two radix services on one bus would both answer every pool), HTTP on a free port."""
from __future__ import annotations

import asyncio

import aiohttp

from radixflow.services.stack import Stack, stack_config
from radixflow.shared.natsd import NatsServer


async def start(model: str, **over) -> Stack:
    """Started and healthy; `st.base` is its HTTP root, `st.http` a session, `st.nats` its server."""
    nats = NatsServer().start()
    st = await Stack(stack_config(nats.url, model, gw_port=0, **over)).start()
    st.nats = nats
    st.base = f"http://127.0.0.1:{st.actors['gateway'].port}"
    st.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    for _ in range(600):      # ready once the grammar workers have booted (seconds on 2 cores)
        async with st.http.get(st.base + "/health") as r:
            if r.status == 200:
                break
        await asyncio.sleep(0.1)
    else:
        raise RuntimeError("stack not healthy in 60 s")
    return st


async def stop(st: Stack) -> None:
    await st.http.close()
    await st.stop()
    st.nats.stop()
