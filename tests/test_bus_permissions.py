"""Every role's key against a real nats-server with radixflow's authorization (shared/creds.py), on
every subject of shared/subjects.py: a key publishes and subscribes where its service's part of the
protocol needs and nowhere else. The table here is written from the protocol (subjects.py's
docstring: who sends what to whom), not derived from creds.PERMISSIONS, so a permission widened
there fails here."""
from __future__ import annotations

import asyncio

import nats
import pytest

from radixflow.shared import creds, subjects as S
from radixflow.shared.bus import registered
from radixflow.shared.natsd import NatsServer

ROLES = creds.ROLES
X = "abc123"                                   # some instance id

# subject -> the roles that send to it
PUBLISHERS: dict[str, set[str]] = {
    S.SCHEDULER_SUBMIT: {"gateway", "client"},
    S.SCHEDULER_ABORT: {"gateway", "client"},
    S.SCHEDULER_PROGRAM: {"gateway", "client"},
    S.PROGRAM_GET: {"gateway", "client"},
    S.PROGRAM_CANCEL: {"gateway", "client"},
    S.program_op(X, "get"): {"gateway", "client"},
    S.program_op(X, "cancel"): {"gateway", "client"},
    S.live("scheduler", X): {"gateway"},
    S.resend(X): {"gateway"},
    S.TOKENIZER_ENCODE: {"gateway", "scheduler", "client"},
    S.TOKENIZER_DETOKENIZE: {"gateway", "scheduler", "client"},
    S.TOKENIZER_INFO: {"gateway", "scheduler"},
    S.GRAMMAR_COMPILE: {"scheduler"},
    S.GRAMMAR_FETCH: {"executor"},
    S.RADIX_REGISTER: {"executor"},
    S.RADIX_ADOPT: {"executor"},
    S.radix_step(X): {"executor"},
    S.RADIX_PLACE: {"scheduler"},
    S.RADIX_FLUSH: {"gateway"},
    S.METRICS: {"gateway"},
    S.MEMORY: {"gateway"},
    S.executor_submit(X): {"scheduler"},
    S.executor_abort(X): {"scheduler"},
    S.executor_hints(X): {"scheduler"},
    S.live("executor", X): {"scheduler"},
    S.replay(X): {"scheduler"},
    S.ping("executor", X): {"scheduler"},
    S.scheduler_output(X): {"executor"},
    S.ping("scheduler", X): {"executor"},
    **{S.status(s): {"gateway"} for s in S.SERVICES},
    **{S.heartbeat(s): {s} for s in S.SERVICES},
    # streams: the scheduler answers into its caller's inbox
    **{f"{creds.inbox_prefix(r)}.rf.tok": {"scheduler"} for r in ("gateway", "client")},
    # nobody may write into a service's own inbox but through a reply (allow_responses)
    **{f"{creds.inbox_prefix(r)}.rf.tok": set() for r in ("scheduler", "executor", "tokenizer", "grammar", "radix")},
    "rf.anything.else": set(),
    "elsewhere": set(),
}

# subscriptions: who listens where (the receiving service, every service on beats and rf.metrics)
SUBSCRIBERS: dict[str, set[str]] = {
    ">": set(),
    "rf.>": set(),
    "_INBOX.>": set(),
    S.SCHEDULER_SUBMIT: {"scheduler"},
    S.scheduler_output(X): {"scheduler"},
    S.TOKENIZER_ENCODE: {"tokenizer"},
    S.GRAMMAR_COMPILE: {"grammar"},
    S.RADIX_PLACE: {"radix"},
    S.radix_step(X): {"radix"},
    S.executor_submit(X): {"executor"},
    S.MEMORY: {"executor"},
    S.METRICS: set(S.SERVICES),
    "rf.heartbeat.>": set(S.SERVICES),
    **{f"{creds.inbox_prefix(r)}.>": {r} for r in ROLES},
    **{f"rf.{s}.>": {s} for s in S.SERVICES},
}


@pytest.fixture(scope="module")
def bus():
    keys = creds.Ephemeral()
    with NatsServer(auth_conf=keys.server_conf) as server:
        yield server, keys
    keys.close()


async def violations(server, keys, role: str, act) -> set[str]:
    """The subjects the server refused to `role` while `act(nc)` ran (lower case: nats-py lowers
    the server's error text)."""
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))
    nc = await nats.connect(server.url, nkeys_seed=creds.seed_file(keys.dir, role),
                            inbox_prefix=creds.inbox_prefix(role), error_cb=on_error, allow_reconnect=False)
    try:
        await act(nc)
        await nc.flush()
        await asyncio.sleep(0.3)
        await nc.flush()
    finally:
        await nc.close()
    return {e.rsplit(" to ", 1)[1].strip('"') for e in errors if "permissions violation" in e}


@pytest.mark.parametrize("role", ROLES)
async def test_a_role_publishes_only_its_subjects(bus, role):
    server, keys = bus

    async def act(nc):
        for subject in PUBLISHERS:
            await nc.publish(subject, b"{}")
    refused = await violations(server, keys, role, act)
    expected = {s for s, who in PUBLISHERS.items() if role not in who}
    assert refused == {s.lower() for s in expected}


@pytest.mark.parametrize("role", ROLES)
async def test_a_role_subscribes_only_where_it_listens(bus, role):
    server, keys = bus

    async def act(nc):
        for subject in SUBSCRIBERS:
            await nc.subscribe(subject)
    refused = await violations(server, keys, role, act)
    expected = {s for s, who in SUBSCRIBERS.items() if role not in who}
    assert refused == {s.lower() for s in expected}


async def test_a_reply_goes_only_to_the_requester(bus):
    """allow_responses: the tokenizer may answer a request it received (into the gateway's inbox),
    and write there at no other time."""
    server, keys = bus
    tok = await nats.connect(server.url, nkeys_seed=creds.seed_file(keys.dir, "tokenizer"),
                             inbox_prefix=creds.inbox_prefix("tokenizer"))
    gw = await nats.connect(server.url, nkeys_seed=creds.seed_file(keys.dir, "gateway"),
                            inbox_prefix=creds.inbox_prefix("gateway"))
    try:
        async def answer(msg):
            await msg.respond(b"tokens")
        await tok.subscribe(S.TOKENIZER_ENCODE, cb=answer)
        await registered(tok)
        reply = await gw.request(S.TOKENIZER_ENCODE, b"text", timeout=5)
        assert reply.data == b"tokens"
        heard = []

        async def hear(msg):
            heard.append(msg)
        sub = await gw.subscribe(f"{creds.inbox_prefix('gateway')}.rf.x", cb=hear)
        await registered(gw)
        await tok.publish(f"{creds.inbox_prefix('gateway')}.rf.x", b"forged")
        await tok.flush()
        await asyncio.sleep(0.3)
        assert heard == []
        await sub.unsubscribe()
    finally:
        await tok.close()
        await gw.close()
