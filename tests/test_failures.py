"""Nothing is lost: dead services become fast, clear errors; shutdown drains in-flight work."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from radixflow.services.stack import ORDER, Stack, stack_config
from radixflow.shared import subjects
from radixflow.shared.bus import Bus
from radixflow.shared.config import BusConfig
from radixflow.shared.messages import StatusReply, StatusRequest
from radixflow.shared.natsd import NatsServer, free_port


@pytest.fixture
def nats():
    with NatsServer() as srv:
        yield srv


async def start(nats, models, names=ORDER, **over) -> Stack:
    cfg = stack_config(nats.url, models["tiny-hybrid"], gw_port=0, sc_executor_timeout_s=1.0,
                       gw_scheduler_timeout_s=1.0, ex_orphan_timeout_s=1.0, **over)
    cfg = dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, heartbeat_s=0.25))
    st = await Stack(cfg, names=names).start()
    if "gateway" in names:
        st.base = f"http://127.0.0.1:{st.actors['gateway'].port}"
    await asyncio.sleep(0.6)   # a heartbeat round, so the scheduler and gateway know the executor
    return st


async def post(base, path, body, timeout=60):
    async with aiohttp.ClientSession() as s:
        async with s.post(base + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.json()


async def crash(stack: Stack, name: str) -> None:
    """Kill a service the hard way: its connection drops without draining, its loops stop."""
    actor = stack.actors.pop(name)
    if hasattr(actor, "_running"):
        actor._running.clear()   # a dead process computes nothing more
    await actor.bus.nc.close()
    for t in actor._loops.values():
        t.cancel()


LONG = {"text": "a long one", "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}


async def test_no_executor_is_a_fast_503(nats, models):
    st = await start(nats, models, names=tuple(n for n in ORDER if n != "executor"))
    try:
        t0 = time.monotonic()
        code, body = await post(st.base, "/generate", {"text": "hello"})
        assert code == 503 and "executor" in body["error"]["message"]
        assert time.monotonic() - t0 < 1.0
        async with aiohttp.ClientSession() as s, s.get(st.base + "/health") as r:
            assert r.status == 503 and (await r.json())["services"]["executor"] is False
    finally:
        await st.stop()


async def test_no_tokenizer_is_a_fast_503(nats, models):
    st = await start(nats, models, names=tuple(n for n in ORDER if n != "tokenizer"))
    try:
        t0 = time.monotonic()
        code, body = await post(st.base, "/generate", {"text": "hello"})
        assert code == 503 and "tokenizer" in body["error"]["message"]
        assert time.monotonic() - t0 < 1.0
    finally:
        await st.stop()


async def test_executor_death_mid_request_ends_it_with_an_error(nats, models):
    st = await start(nats, models)
    try:
        task = asyncio.create_task(post(st.base, "/generate", LONG))
        await asyncio.sleep(1.0)
        assert not task.done()
        t0 = time.monotonic()
        await crash(st, "executor")
        code, body = await asyncio.wait_for(task, 10)
        assert code == 503 and "stopped responding" in body["error"]["message"]
        assert time.monotonic() - t0 < 3.0
        assert len(st.actors["scheduler"].table) == 0
    finally:
        await st.stop()


async def test_scheduler_death_mid_stream_ends_it_with_an_error(nats, models):
    st = await start(nats, models)
    try:
        events = []

        async def stream():
            async with aiohttp.ClientSession() as s:
                async with s.post(st.base + "/generate", json=LONG | {"stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip())
        task = asyncio.create_task(stream())
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        await crash(st, "scheduler")
        await asyncio.wait_for(task, 10)
        assert time.monotonic() - t0 < 3.0
        err = json.loads(events[-2])
        assert err["error"]["code"] == 503 and "scheduler" in err["error"]["message"]
        assert events[-1] == b"[DONE]"
        ex = st.actors["executor"]          # the orphaned request stops computing too
        for _ in range(40):
            if not ex.engine.has_work():
                break
            await asyncio.sleep(0.1)
        assert not ex.engine.has_work()
    finally:
        await st.stop()


async def test_long_prefill_does_not_block_the_event_loop(nats, models):
    st = await start(nats, models, names=tuple(n for n in ORDER if n != "gateway"))
    bus = Bus("probe", BusConfig(nats_url=nats.url))
    await bus.connect()
    try:
        from radixflow.shared.messages import ExecRequest, SamplingParams
        ex = st.actors["executor"]
        ex.engine.add(ExecRequest(rid="big", input_ids=list(range(3, 7003)),
                                  sampling=SamplingParams(max_new_tokens=1, temperature=0)))
        ex._wake.set()
        await asyncio.sleep(0.05)
        lat = []
        while ex.engine.has_work():
            t0 = time.monotonic()
            await bus.request(subjects.status("executor"), StatusRequest(), StatusReply, timeout=2)
            lat.append(time.monotonic() - t0)
            await asyncio.sleep(0.02)
        assert len(lat) >= 3, "the prefill was too short to probe"
        assert max(lat) < 0.5, lat
    finally:
        await bus.close()
        await st.stop()


async def test_stop_drains_in_flight_requests(nats, models):
    st = await start(nats, models)
    body = {"text": "drain me", "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    tasks = [asyncio.create_task(post(st.base, "/generate", body)) for _ in range(4)]
    await asyncio.sleep(0.3)
    await st.stop()
    res = await asyncio.gather(*tasks)
    assert all(code == 200 and r["meta_info"]["completion_tokens"] == 40 for code, r in res), res


async def test_stop_with_the_bus_gone_waits_one_drain_timeout_in_all(models):
    """Once NATS is gone in-flight work cannot finish: the stack's stop waits out one drain timeout
    in all, not one per service one after another (each of the six waited its own), and the request
    in flight ends."""
    srv = NatsServer().start()
    try:
        cfg = stack_config(srv.url, models["tiny-hybrid"], gw_port=0)
        cfg = dataclasses.replace(cfg, service=dataclasses.replace(cfg.service, heartbeat_s=0.25, drain_timeout_s=2.0))
        st = await Stack(cfg).start()
        base = f"http://127.0.0.1:{st.actors['gateway'].port}"
        await asyncio.sleep(0.6)
        task = asyncio.create_task(post(base, "/generate", LONG))
        await asyncio.sleep(1.0)
        assert not task.done()
        srv.stop()
        t0 = time.monotonic()
        await st.stop()
        took = time.monotonic() - t0
        code, body = await asyncio.wait_for(task, 10)
        assert code == 503 and "shutting down" in body["error"]["message"], body
        assert took < 6.0, took           # before: 60 s (aiohttp's cleanup waited for the request)
    finally:
        srv.stop()


@pytest.mark.parametrize("group", [False, True], ids=["sigterm", "sigint-to-the-group"])
def test_radixflow_up_serves_and_drains_on_sigterm(models, tmp_path, group):
    """The real command: embedded nats-server, all services, HTTP; SIGTERM lets a request finish. So
    does a terminal's Ctrl-C, a SIGINT to the whole process group: the embedded nats-server is in a
    group of its own and stops after the drain (it used to get the signal too, and exit at once: the
    request failed, and `up` took minutes to exit)."""
    import requests
    port = free_port()
    log = open(tmp_path / "up.log", "w")
    p = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "radixflow"), "up", "--model",
                          models["tiny-dense"], "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=group)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            assert p.poll() is None, open(tmp_path / "up.log").read()[-2000:]
            try:
                if requests.get(base + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() < deadline, "not healthy in 90 s"
            time.sleep(0.3)
        if not group:     # its embedded nats-server takes no anonymous client; its keys go with it
            import asyncio
            import re

            import nats
            log.flush()
            text = open(tmp_path / "up.log").read()
            url, keydir = re.search(r"embedded nats-server on (\S+) \(nkeys in (\S+)\)", text).groups()

            async def anonymous():
                with pytest.raises(Exception, match="Authorization Violation"):
                    await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
            asyncio.run(anonymous())
            assert oct(os.stat(keydir).st_mode & 0o777) == "0o700"
        import threading
        out = {}
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
        t = threading.Thread(target=lambda: out.setdefault("r", requests.post(base + "/generate", json=body, timeout=60)))
        t.start()
        time.sleep(0.5)
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM)
        t.join(60)
        assert out["r"].status_code == 200 and out["r"].json()["meta_info"]["completion_tokens"] == 400
        assert p.wait(30) == 0
        if not group:
            assert not os.path.exists(keydir)          # the run's keys are removed with it
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL) if group else p.kill()
        log.close()


async def test_a_lost_output_is_fetched_again_from_the_executor(nats, models):
    """NATS delivers at most once: a StepOutput lost on the way (dropped here at the scheduler's
    intake, as a reconnect would) shows as an offset gap, and the scheduler fetches the missing
    tokens from the executor (rf.executor.<id>.replay) instead of failing the request."""
    from radixflow.shared.ids import scoped
    from radixflow.shared.messages import Replay, Replayed
    st = await start(nats, models)
    bus = Bus("probe", BusConfig(nats_url=nats.url))
    await bus.connect()
    try:
        body = {"text": "a story", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
        code, want = await post(st.base, "/generate", body)
        assert code == 200
        ex, sched = st.actors["executor"], st.actors["scheduler"]
        # the executor answers a replay from any offset, after the request ended too
        # (inside the engine a request's id is scoped by its tenant: shared/ids.py)
        r = await bus.request(subjects.replay(ex.instance), Replay(rid=scoped("default", want["meta_info"]["id"]),
                                                                   offset=5), Replayed)
        assert r.found and r.token_ids == want["output_ids"][5:]
        route = next(r for r in sched._routes if r.subject == sched.output_subject)
        intake, dropped = route.fn, []

        async def lossy(step):
            if not dropped and any(o.token_ids and o.offset >= 3 and not o.finished for o in step.outputs):
                dropped.append(step)
                return
            await intake(step)
        route.fn = lossy
        try:
            # a stop string (that never matches) makes the executor report every step: without one a
            # non-streamed request is quiet (its first output and its end only), with nothing between to lose
            loud = body | {"sampling_params": body["sampling_params"] | {"stop": ["<never printed>"]}}
            code, got = await post(st.base, "/generate", loud | {"stream": False})
        finally:
            route.fn = intake
        assert dropped and code == 200
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        assert sched.recovery.replayed_total >= len(dropped[0].outputs[0].token_ids)
    finally:
        await bus.close()
        await st.stop()


async def test_a_request_of_a_dead_executor_that_streamed_nothing_moves_to_another(nats, models):
    """Two executors; one holds its requests without computing (its compute loop stopped) and then
    dies. Its requests had streamed nothing, so the scheduler starts them over on the other one:
    they succeed, only later."""
    from radixflow.services.executor.service import ExecutorService
    st = await start(nats, models, names=tuple(n for n in ORDER if n != "executor"))
    exs = []
    try:
        for _ in range(2):
            bus = Bus("radixflow-executor", st.cfg.bus)
            await bus.connect()
            ex = ExecutorService(bus, st.cfg.executor, st.cfg.service)
            await ex.start()
            exs.append(ex)
        sched = st.actors["scheduler"]
        for _ in range(40):
            if len(sched.live_executors()) == 2:
                break
            await asyncio.sleep(0.1)
        stuck, ok = exs
        stuck._running.clear()          # its compute loop ends: requests sent there wait
        stuck._wake.set()
        stuck_load = lambda: sched.executors[stuck.instance].inflight if stuck.instance in sched.executors else 0
        tasks = []
        while stuck_load() < 2 and len(tasks) < 12:
            tasks.append(asyncio.create_task(post(st.base, "/generate", {
                "text": f"move me {len(tasks)}", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})))
            await asyncio.sleep(0.05)
        assert stuck_load() >= 1
        moved = sched.recovery.retried_total
        await stuck.bus.nc.close()      # it dies
        for t in stuck._loops.values():
            t.cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 15)
        assert all(code == 200 for code, _ in results), results
        assert sched.recovery.retried_total > moved
    finally:
        for ex in exs:
            ex._running.clear()
            ex._wake.set()
        await exs[1].drain(2)
        await exs[1].stop()
        await st.stop()
