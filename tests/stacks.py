"""Whole stacks for integration tests: every service in this process, on a nats-server of its own
(two radix services on one bus would both answer every pool), HTTP on a free port."""
from __future__ import annotations

import asyncio

import aiohttp

from radixflow.services.stack import Stack, stack_config
from radixflow.shared import creds
from radixflow.shared.natsd import NatsServer


async def start(model: str, secured: bool = False, **over) -> Stack:
    """Started and healthy; `st.base` is its HTTP root, `st.http` a session, `st.nats` its server.
    secured: NATS as `radixflow up` runs it, each service with its own nkey and permissions
    (`st.creds.dir` holds the keys, client.nk among them)."""
    keys = creds.Ephemeral() if secured else None
    nats = NatsServer(auth_conf=keys.server_conf if keys else "").start()
    if keys:
        over["bus_nkey_dir"] = keys.dir
    st = await Stack(stack_config(nats.url, model, gw_port=0, **over)).start()
    st.nats, st.creds = nats, keys
    st.base = f"http://127.0.0.1:{st.actors['gateway'].port}"
    st.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
    await wait_healthy(st.base)
    return st


async def wait_healthy(base: str, timeout_s: float = 90.0) -> None:
    """Until /health is 200 (the grammar workers boot for seconds on 2 cores); raises if it never is."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = None
    async with aiohttp.ClientSession() as http:
        while asyncio.get_running_loop().time() < deadline:
            async with http.get(base + "/health") as r:
                if r.status == 200:
                    return
                last = await r.text()
            await asyncio.sleep(0.1)
    raise RuntimeError(f"stack not healthy in {timeout_s:g} s: {last}")


async def stop(st: Stack) -> None:
    await st.http.close()
    await st.stop()
    st.nats.stop()
    if st.creds is not None:
        st.creds.close()
