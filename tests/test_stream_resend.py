"""Scheduler -> gateway: a stream item lost on the way (NATS delivers at most once: a reconnect, a
node failover) is sent again by the scheduler (rf.scheduler.<id>.resend), so the stream completes
as if nothing happened, instead of ending with a 502 gap."""
from __future__ import annotations

import json

import aiohttp
import pytest

from radixflow.services.scheduler.streamlog import MAX_RESENT, StreamLog
from radixflow.shared import recent
from radixflow.shared.messages import StreamBatch, StreamChunk, StreamError

from radixflow.shared.natsd import NatsServer

from .test_failures import post, start


@pytest.fixture
def nats():
    with NatsServer() as srv:
        yield srv

BODY = {"text": "a story about the sea", "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}


async def sse(base: str, body: dict) -> tuple[int, list[dict]]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/generate", json=body | {"stream": True}, timeout=aiohttp.ClientTimeout(total=60)) as r:
            items = []
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    items.append(json.loads(line[5:]))
            return r.status, items


def lose(sched, which) -> list:
    """Drop, once, the first stream item the scheduler publishes for which which(item) holds (alone,
    or out of the StreamBatch that carries it)."""
    real, dropped = sched.bus.publish, []

    async def lossy(subject, msg, as_json=False):
        if not dropped and isinstance(msg, (StreamChunk, StreamError)) and which(msg):
            dropped.append(msg)
            return
        if not dropped and isinstance(msg, StreamBatch) and any(which(i) for i in msg.items):
            k = next(k for k, i in enumerate(msg.items) if which(i))
            dropped.append(msg.items[k])
            msg = StreamBatch(subjects=msg.subjects[:k] + msg.subjects[k + 1:], items=msg.items[:k] + msg.items[k + 1:])
        await real(subject, msg, as_json)
    sched.bus.publish = lossy
    return dropped


async def test_a_lost_chunk_mid_stream_is_sent_again(nats, models):
    st = await start(nats, models)
    try:
        code, want = await post(st.base, "/generate", BODY)
        assert code == 200
        dropped = lose(st.actors["scheduler"], lambda m: m.seq == 3 and not m.finished)
        code, items = await sse(st.base, BODY)
        assert code == 200 and dropped
        assert not any("error" in i for i in items), items[-1]
        # every event carries the text so far: each one is a prefix of the answer, the last is it
        assert all(want["text"].startswith(i["text"]) for i in items)
        assert items[-1]["text"] == want["text"] and items[-1]["output_ids"] == want["output_ids"]
        assert st.actors["gateway"].client.resent_total >= 1
    finally:
        await st.stop()


async def test_a_lost_end_of_stream_is_sent_again_after_the_stall_probe(nats, models):
    st = await start(nats, models, gw_stall_check_s=0.5)
    try:
        code, want = await post(st.base, "/generate", BODY)
        assert code == 200
        dropped = lose(st.actors["scheduler"], lambda m: isinstance(m, StreamError) or m.finished)
        code, got = await post(st.base, "/generate", BODY)
        assert dropped and code == 200, got
        assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
        assert st.actors["gateway"].client.resent_total >= 1
    finally:
        await st.stop()


def chunk(seq: int, finished: bool = False) -> StreamChunk:
    return StreamChunk(rid="r", seq=seq, text=str(seq), finished=finished)


def test_the_log_answers_from_any_seq_until_keep_s_after_the_end(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(recent.time, "monotonic", lambda: now[0])
    log = StreamLog(keep_s=30)
    for s in range(5):
        log.record("a", chunk(s), False)
    assert [i.seq for i in log.since("a", 2)] == [2, 3, 4]
    assert log.since("a", 5) == [] and log.since("b", 0) is None
    log.record("a", chunk(5, True), True)
    now[0] += 29
    assert [i.seq for i in log.since("a", 5)] == [5]
    now[0] += 2
    assert log.since("a", 0) is None and len(log) == 0


def test_the_log_is_bounded():
    log = StreamLog(max_streams=3, max_items=10)
    for s in range(25):
        log.record("a", chunk(s), False)
    assert log.since("a", 14) is None                 # older than what is kept: past mending
    assert [i.seq for i in log.since("a", 15)] == list(range(15, 25))
    for name in "bcd":
        log.record(name, chunk(0), False)
    assert len(log) == 3 and log.since("a", 20) is None     # the oldest stream went first
    big = StreamLog()
    for s in range(2 * MAX_RESENT):
        big.record("x", chunk(s), False)
    assert len(big.since("x", 0)) == MAX_RESENT      # one answer stays small; the gateway asks again


def test_an_unsendable_end_is_replaced_by_the_error_sent_in_its_place():
    log = StreamLog()
    log.record("a", chunk(0), False)
    log.record("a", chunk(1, True), True)
    log.record("a", StreamError(rid="r", seq=1, code=413, kind="payload_too_large", message="too big"), True)
    got = log.since("a", 1)
    assert len(got) == 1 and isinstance(got[0], StreamError)
