"""shared/eventloop.py: uvloop where installed, asyncio's loop when RADIXFLOW_LOOP=asyncio, and the
services run on either."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from radixflow.shared import eventloop


def _loop_in_child(env_loop: str | None) -> str:
    env = dict(os.environ)
    env.pop("RADIXFLOW_LOOP", None)
    if env_loop is not None:
        env["RADIXFLOW_LOOP"] = env_loop
    code = ("import asyncio\nfrom radixflow.shared import eventloop\n"
            "async def main():\n    return type(asyncio.get_running_loop()).__module__.split('.')[0]\n"
            "print(eventloop.name(), eventloop.run(main()))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()


def test_uvloop_by_default_asyncio_when_asked():
    import uvloop  # noqa: F401 - a dependency: the default loop must be it
    assert _loop_in_child(None) == ["uvloop", "uvloop"]
    assert _loop_in_child("asyncio") == ["asyncio", "asyncio"]


def test_run_returns_the_result_and_raises_the_error():
    async def ok():
        await asyncio.sleep(0)
        return 7

    async def bad():
        raise ValueError("x")
    assert eventloop.run(ok()) == 7
    try:
        eventloop.run(bad())
    except ValueError as e:
        assert str(e) == "x"
    else:
        raise AssertionError("the coroutine's error was lost")


async def test_the_suite_runs_on_the_services_loop():
    assert type(asyncio.get_running_loop()).__module__.split(".")[0] == eventloop.name()
