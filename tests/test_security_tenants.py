"""One tenant cannot hurt or learn about another, tried as an attacker would against a live server
with keys for alpha, beta and gamma: hostile schema patterns (ReDoS) through /generate and
/v1/chat/completions while beta is served; ids that collide across tenants."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from .stacks import start, stop

KEYS = {"keys": {"ka": {"tenant": "alpha"}, "kb": {"tenant": "beta"}, "kc": {"tenant": "gamma"},
                 "kadmin": {"tenant": "ops", "role": "admin"}}}
# the lookahead holds the backtracking; the rest (a{N}) is what the grammar enforces, so that the
# model writes exactly the string that sets it off. The first is the issue's own: the `regex` engine
# cuts it short (the output fails the pattern: resampled, then a clear 500); the others run to the
# check's budget (a clear 400)
SHAPES = [(r"^(?=(a+)+b)a{30}$", False), (r"^(?=(a|aa)+b)a{40}$", True), (r"^(?=(a|a)+b)a{30}$", True),
          (r"^(?=(a|ab|aa)+c)a{40}$", True)]
VICTIM_BOUND_S = 60.0      # generous: beta's two tokens take well under a second on an idle stack


def schema(pattern: str) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"],
            "additionalProperties": False}


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
async def server(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("sec") / "keys.json"
    path.write_text(json.dumps(KEYS))
    st = await start(models["tiny-dense"], secured=True, gw_auth_file=str(path))
    yield st
    await stop(st)


async def post(st, path: str, key: str, body: dict) -> tuple[int, dict]:
    async with st.http.post(st.base + path, json=body, headers=auth(key)) as r:
        return r.status, await r.json()


async def victim(st) -> float:
    """beta's two-token request, timed; asserts it is served."""
    t0 = time.monotonic()
    status, body = await post(st, "/v1/completions", "kb", {"model": "m", "prompt": "Hello there", "max_tokens": 2,
                                                             "temperature": 0})
    assert status == 200, body
    return time.monotonic() - t0


async def attack(st, hostile, slow: bool) -> tuple[int, dict]:
    """Run the hostile request; while its check runs (or, for a pattern the engine cuts short,
    while it is in flight) beta is served within the bound and /health stays 200."""
    sched = st.actors["scheduler"]
    task = asyncio.ensure_future(hostile)
    deadline = time.monotonic() + 120
    while not task.done() and time.monotonic() < deadline and (sched.checks.running == 0 if slow else False):
        await asyncio.sleep(0.005)
    assert not slow or sched.checks.running > 0 or task.done()
    took = await victim(st)
    assert took < VICTIM_BOUND_S
    async with st.http.get(st.base + "/health") as r:
        assert r.status == 200
    return await task


def clear_error(status: int, body: dict, slow: bool) -> None:
    err = body["error"]
    if slow:
        assert status == 400 and err["type"] == "invalid_request_error" and "budget" in err["message"], body
    else:   # the engine answered fast: the output fails the pattern, is resampled, then fails clearly
        assert status in (400, 500) and "pattern" in err["message"] or "does not match" in err["message"], body


@pytest.mark.parametrize("pattern,slow", SHAPES)
async def test_hostile_patterns_through_generate(server, pattern, slow):
    before = server.actors["scheduler"].checks.timeouts
    body = {"text": "Say it:", "sampling_params": {"max_new_tokens": 120, "temperature": 0,
                                                   "json_schema": json.dumps(schema(pattern))}}
    status, reply = await attack(server, post(server, "/generate", "ka", body), slow)
    clear_error(status, reply, slow)
    assert server.actors["scheduler"].checks.timeouts == before + slow
    if slow:   # the same schema again is refused at once: it does not take a check thread again
        status, again = await post(server, "/generate", "ka", body)
        assert status == 400 and "recently" in again["error"]["message"]
        assert server.actors["scheduler"].checks.timeouts == before + 1


@pytest.mark.parametrize("pattern,slow", SHAPES)
async def test_hostile_patterns_through_chat(server, pattern, slow):
    # gamma: alpha's schemas are refused to alpha now; what was slow for alpha says nothing to gamma
    body = {"model": "m", "messages": [{"role": "user", "content": "Say it"}], "max_tokens": 120, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(pattern)}}}
    status, reply = await attack(server, post(server, "/v1/chat/completions", "kc", body), slow)
    clear_error(status, reply, slow)


async def test_a_refused_schema_is_refused_to_that_tenant_only(server):
    body = {"text": "Say it:", "sampling_params": {"max_new_tokens": 120, "temperature": 0,
                                                   "json_schema": json.dumps(schema(SHAPES[1][0]))}}
    status, _ = await post(server, "/generate", "ka", body)
    assert status == 400
    ok = {"text": "Say it:", "sampling_params": {"max_new_tokens": 60, "temperature": 0,
                                                 "json_schema": json.dumps(schema("^a{3}$"))}}
    status, reply = await post(server, "/generate", "ka", ok)
    assert status == 200 and json.loads(reply["text"]) == {"s": "aaa"}


# ---------------------------------------------------------------- ids


async def test_colliding_rids_are_each_tenants_own(server):
    """beta reusing alpha's in-flight rid is served; beta's abort of it does not touch alpha's."""
    long = {"text": "Count:", "rid": "shared-rid", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}}
    async with server.http.post(server.base + "/generate", json=long, headers=auth("ka")) as a:
        assert a.status == 200
        await a.content.readline()                          # alpha's is running
        status, b = await post(server, "/generate", "kb", {"text": "Hi", "rid": "shared-rid",
                                                            "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and b["meta_info"]["id"] == "shared-rid"
        status, _ = await post(server, "/abort_request", "kb", {"rid": "shared-rid"})
        assert status == 200
        events = [json.loads(line[5:]) async for line in a.content if line.startswith(b"data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"     # beta's abort did nothing
    assert events[-1]["meta_info"]["completion_tokens"] == 200


async def test_alpha_can_abort_its_own(server):
    long = {"text": "Count:", "rid": "mine", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    async with server.http.post(server.base + "/generate", json=long, headers=auth("ka")) as a:
        await a.content.readline()
        status, _ = await post(server, "/abort_request", "ka", {"rid": "mine"})
        assert status == 200
        events = [json.loads(line[5:]) async for line in a.content if line.startswith(b"data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_colliding_program_ids_are_each_tenants_own(server):
    long = {"id": "prog-1", "stream": True,
            "nodes": [{"id": "n", "text": "Count:", "gen": {"max_tokens": 3000, "ignore_eos": True}}]}
    async with server.http.post(server.base + "/v1/programs", json=long, headers=auth("ka")) as a:
        assert a.status == 200
        await a.content.readline()
        async with server.http.get(server.base + "/v1/programs/prog-1", headers=auth("kb")) as r:
            assert r.status == 404                          # beta sees nothing of alpha's program
        async with server.http.delete(server.base + "/v1/programs/prog-1", headers=auth("kb")) as r:
            assert r.status == 404                          # ... and cannot cancel it
        status, mine = await post(server, "/v1/programs", "kb", {"id": "prog-1", "nodes": [
            {"id": "n", "text": "Hi", "gen": {"max_tokens": 2}}]})
        assert status == 200 and mine["state"] == "finished" and mine["id"] == "prog-1"
        async with server.http.get(server.base + "/v1/programs/prog-1", headers=auth("ka")) as r:
            assert r.status == 200 and (await r.json())["state"] == "running"   # untouched by beta's
        async with server.http.delete(server.base + "/v1/programs/prog-1", headers=auth("ka")) as r:
            assert r.status == 200                          # its owner can cancel it
        lines = [line async for line in a.content if line.startswith(b"data: {")]
    assert json.loads(lines[-1][5:])["state"] == "cancelled"


# ---------------------------------------------------------------- shares and /metrics


async def test_a_batch_is_capped(server):
    from radixflow.shared.validate import MAX_BATCH
    status, body = await post(server, "/v1/completions", "ka", {"model": "m", "prompt": ["x"] * (MAX_BATCH + 1),
                                                                 "max_tokens": 1})
    assert status == 400 and "at most" in body["error"]["message"]
    status, body = await post(server, "/generate", "ka", {"text": ["x"] * 200, "sampling_params": {"n": 2}})
    assert status == 400


async def test_metrics_need_a_key_and_show_only_the_callers_tenant(server):
    await post(server, "/v1/completions", "ka", {"model": "m", "prompt": "metrics a", "max_tokens": 1})
    await post(server, "/v1/completions", "kb", {"model": "m", "prompt": "metrics b", "max_tokens": 1})
    async with server.http.get(server.base + "/metrics") as r:
        assert r.status == 401
    async with server.http.get(server.base + "/metrics", headers=auth("nope")) as r:
        assert r.status == 401
    async with server.http.get(server.base + "/metrics", headers=auth("ka")) as r:
        assert r.status == 200
        mine = await r.text()
    assert 'tenant="alpha"' in mine and 'tenant="beta"' not in mine and 'tenant="unknown"' not in mine
    assert 'scope="beta"' not in mine and "radixflow_requests_inflight" in mine      # untenanted series stay
    async with server.http.get(server.base + "/metrics", headers=auth("kadmin")) as r:
        everything = await r.text()
    assert 'tenant="alpha"' in everything and 'tenant="beta"' in everything


async def test_health_generate_is_shared_not_a_free_generation(server):
    async with server.http.get(server.base + "/health_generate") as r:
        first = await r.json()
        assert r.status == 200 and first["status"] == "ok"
    served = server.actors["scheduler"].tenants.tenants["!health"].requests_total
    for _ in range(5):
        async with server.http.get(server.base + "/health_generate") as r:
            assert r.status == 200
    assert server.actors["scheduler"].tenants.tenants["!health"].requests_total == served   # the cached result


async def test_one_tenants_batch_cannot_push_another_to_429(models):
    """A small server (a queue of 40, a tenant's default share half of it): alpha's batches fill its
    share and get 429, beta is still served."""
    st = await start(models["tiny-dense"], secured=True, gw_api_keys=("ka:alpha", "kb:beta"),
                     sc_max_queued_requests=40)
    try:
        big = {"text": ["Count to a thousand:"] * 30, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
        flood = [asyncio.ensure_future(post(st, "/generate", "ka", big)) for _ in range(3)]
        sched = st.actors["scheduler"]
        deadline = time.monotonic() + 60
        while sched.tenants.tenants.get("alpha") is None or sched.tenants.tenants["alpha"].rejected_total == 0:
            assert time.monotonic() < deadline, "alpha never reached its share"
            await asyncio.sleep(0.01)
        assert sched.tenants.tenants["alpha"].inflight <= 20
        status, body = await post(st, "/generate", "kb", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert status == 200, body
        results = await asyncio.gather(*flood)
        assert any(s == 429 for s, _ in results)
        assert sched.tenants.tenants["beta"].rejected_total == 0
    finally:
        await stop(st)


# ---------------------------------------------------------------- no orphans


async def test_requests_of_a_gone_gateway_are_dropped(server):
    """A gateway that stops beating leaves nobody to read its streams: its requests end and leave
    their executor, instead of running to their deadline."""
    from radixflow.shared import subjects
    from radixflow.shared.bus import Bus
    from radixflow.shared.config import BusConfig
    from radixflow.shared.messages import Accepted, GenerateRequest, Heartbeat, SamplingParams, StreamError
    sched = server.actors["scheduler"]
    bus = Bus("fake-gateway", BusConfig(nats_url=server.nats.url, nkey_dir=server.creds.dir), role="gateway")
    await bus.connect()
    try:
        await bus.publish(subjects.heartbeat("gateway"), Heartbeat(service="gateway", instance="gw-gone", ts=time.time()))
        async with bus.open_stream(idle_timeout_s=60) as s:
            await bus.request(subjects.SCHEDULER_SUBMIT, GenerateRequest(
                rid="orphan", stream_subject=s.subject, text="Count forever:", tenant="alpha", origin="gw-gone",
                sampling=SamplingParams(max_new_tokens=30_000, ignore_eos=True)), Accepted)
            t0 = time.monotonic()
            items = [i async for i in s]
        assert isinstance(items[-1], StreamError) and items[-1].code == 503 and "gw-gone" in items[-1].message
        assert time.monotonic() - t0 < 60
        assert "alpha/orphan" not in sched.table
    finally:
        await bus.close()


# ---------------------------------------------------------------- closed by default


def test_a_gateway_without_keys_refuses_a_public_address():
    from radixflow.services.gateway.service import GatewayService, loopback
    from radixflow.shared.bus import Bus
    from radixflow.shared.config import BusConfig, GatewayConfig
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("10.1.2.3")
    bus = Bus("gw-test", BusConfig(nats_url="nats://127.0.0.1:1"))
    with pytest.raises(ValueError, match="--insecure"):
        GatewayService(bus, GatewayConfig(host="0.0.0.0"))
    GatewayService(bus, GatewayConfig(host="0.0.0.0", api_keys=("k:t",)))      # with keys: fine
    GatewayService(bus, GatewayConfig(host="0.0.0.0", insecure=True))          # told so: fine


def test_processes_keep_keys_off_command_lines():
    from radixflow.services.cli.main import _passthrough
    assert _passthrough(["up", "--processes", "--api-key", "k:a", "--api-key=k2:b", "--dtype", "float32"]) \
        == ("--dtype", "float32")


# ---------------------------------------------------------------- the bus


async def anonymous_is_refused(url: str) -> None:
    import nats
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)


async def test_an_anonymous_nats_client_is_refused(server):
    await anonymous_is_refused(server.nats.url)


async def test_a_services_key_cannot_publish_anothers_subjects(server):
    """The tokenizer's key cannot submit, pose as an executor's output or ask radix about a namespace;
    the NATS-client key cannot listen to everything. Violations are refused by the server (a
    publish is dropped, with an error to the client; a request gets no answer)."""
    import nats
    from radixflow.shared import creds
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))
    nc = await nats.connect(server.nats.url, nkeys_seed=creds.seed_file(server.creds.dir, "tokenizer"),
                            inbox_prefix=creds.inbox_prefix("tokenizer"), error_cb=on_error)
    try:
        sched = server.actors["scheduler"]
        for subject in ("rf.scheduler.submit", f"rf.scheduler.{sched.instance}.output", "rf.radix.place",
                        "rf.heartbeat.executor"):
            await nc.publish(subject, b"{}")
        await nc.flush()
        await asyncio.sleep(0.3)
        assert sum("permissions violation" in e for e in errors) == 4, errors
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("rf.radix.place", b"{}", timeout=1)
    finally:
        await nc.close()
    errors.clear()
    client = await nats.connect(server.nats.url, nkeys_seed=creds.seed_file(server.creds.dir, "client"),
                                inbox_prefix=creds.inbox_prefix("client"), error_cb=on_error)
    try:
        await client.subscribe(">")
        await client.subscribe("_INBOX.gateway.>")          # a gateway's streams: not the client's
        await client.flush()
        await asyncio.sleep(0.3)
        assert sum("permissions violation" in e for e in errors) == 2, errors
    finally:
        await client.close()


async def test_the_nats_client_key_serves_the_public_api(server):
    """A NATS API client with its key: submit, read its stream (under its own inbox)."""
    from radixflow.shared import subjects
    from radixflow.shared.bus import Bus
    from radixflow.shared.config import BusConfig
    from radixflow.shared.messages import Accepted, GenerateRequest, SamplingParams, StreamChunk
    bus = Bus("api-client", BusConfig(nats_url=server.nats.url, nkey_dir=server.creds.dir), role="client")
    await bus.connect()
    try:
        async with bus.open_stream(idle_timeout_s=60) as s:
            await bus.request(subjects.SCHEDULER_SUBMIT, GenerateRequest(
                rid="via-nats", stream_subject=s.subject, text="Hello", tenant="alpha",
                sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)), Accepted)
            items = [i async for i in s]
        assert isinstance(items[-1], StreamChunk) and items[-1].finished and items[-1].rid == "via-nats"
    finally:
        await bus.close()


async def test_a_stream_goes_only_to_an_inbox(server):
    """A submitter cannot point a scheduler's stream at a service's subject (an executor's abort,
    say): a 400 before anything runs, for requests and programs."""
    from radixflow.shared import subjects
    from radixflow.shared.bus import Bus
    from radixflow.shared.config import BusConfig
    from radixflow.shared.errors import BadRequest
    from radixflow.shared.messages import (Accepted, GenerateRequest, ProgramAccepted, ProgramRequest,
                                           SamplingParams)
    bus = Bus("api-client", BusConfig(nats_url=server.nats.url, nkey_dir=server.creds.dir), role="client")
    await bus.connect()
    try:
        for subject in ("rf.executor.x.abort", "_INBOX.client.>", "_INBOX.client.rf.*"):
            with pytest.raises(BadRequest, match="stream_subject"):
                await bus.request(subjects.SCHEDULER_SUBMIT, GenerateRequest(
                    rid="elsewhere", stream_subject=subject, text="Hello", tenant="alpha",
                    sampling=SamplingParams(max_new_tokens=3)), Accepted)
        with pytest.raises(BadRequest, match="stream_subject"):
            await bus.request(subjects.SCHEDULER_PROGRAM, ProgramRequest(
                id="p-elsewhere", stream_subject="rf.radix.flush", nodes=[], tenant="alpha"), ProgramAccepted)
    finally:
        await bus.close()
