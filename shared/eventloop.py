"""The event loop every radixflow process runs its services on: uvloop where it is installed (a
dependency on Linux and macOS), asyncio's own otherwise, or when RADIXFLOW_LOOP=asyncio.

Why: under `radixflow up` the six services share one loop, and a request crosses it about ten times
(NATS messages in and out, the HTTP request and response); its per-callback and per-socket-call
costs are the service path's cost. Measured with `radixflow bench latency` (tiny-hybrid, 2 cores):
a 1-token request's overhead over the in-process Engine was 4.5-4.7 ms on uvloop against 5.6-5.8 ms
on asyncio's loop, two runs each, alternated."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def uvloop_module():
    """uvloop, or None where it is absent or turned off."""
    if os.environ.get("RADIXFLOW_LOOP", "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def name() -> str:
    return "uvloop" if uvloop_module() is not None else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    uv = uvloop_module()
    return uv.new_event_loop() if uv is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the loop above."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
