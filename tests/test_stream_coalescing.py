"""Streamed output coalesced: a scheduler pass sends every stream's items to a gateway in one
StreamBatch, a scheduler behind its executors takes the waiting steps in before it makes text, and
an executor behind its compute joins the steps it has not sent yet (services/executor/service.py:
merged). None of it may change a token, reorder a stream or end one twice."""
from __future__ import annotations

import asyncio
import json

import pytest

from radixflow.services.executor.service import merged
from radixflow.shared.messages import SeqOutput, StreamBatch, StreamChunk, StreamError

from .stacks import start, stop

N = 12
PROMPTS = [f"request {i}: a story about the sea and the {i} ships" for i in range(N)]


def body(i: int, stream: bool) -> dict:
    return {"text": PROMPTS[i], "stream": stream,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}


async def sse(st, b: dict) -> list[dict]:
    async with st.http.post(st.base + "/generate", json=b) as r:
        assert r.status == 200, await r.text()
        events, done = [], 0
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                done += 1
                continue
            events.append(json.loads(line[5:]))
        assert done == 1
        return events


async def quiet(st, b: dict) -> dict:
    async with st.http.post(st.base + "/generate", json=b) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def spy(st) -> dict:
    """Counts what the scheduler publishes: StreamBatch messages, and the stream items sent in
    them and alone."""
    sched = st.actors["scheduler"]
    real, seen = sched.bus.publish, {"batches": 0, "batched": 0, "alone": 0}

    async def counting(subject, msg, as_json=False):
        if isinstance(msg, StreamBatch):
            seen["batches"] += 1
            seen["batched"] += len(msg.items)
        elif isinstance(msg, (StreamChunk, StreamError)):
            seen["alone"] += 1
        await real(subject, msg, as_json)
    sched.bus.publish = counting
    return seen


@pytest.fixture(scope="module", params=[True, False], ids=["coalesced", "item-by-item"])
async def stack(request, models):
    st = await start(models["tiny-hybrid"], gw_coalesce_streams=request.param)
    st.coalesced = request.param
    yield st
    await stop(st)


async def test_streamed_and_quiet_greedy_tokens_are_identical(stack):
    seen = spy(stack)
    streams = await asyncio.gather(*(sse(stack, body(i, True)) for i in range(N)))
    quiets = await asyncio.gather(*(quiet(stack, body(i, False)) for i in range(N)))
    for i, (events, q) in enumerate(zip(streams, quiets)):
        # every event carries the output so far: its tokens only grow, and end where the quiet one did
        ids = [e["output_ids"] for e in events]
        assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:])), f"stream {i} is out of order"
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        assert counts == sorted(counts) and counts[-1] == 40
        finished = [e for e in events if e["meta_info"]["finish_reason"] is not None]
        assert len(finished) == 1 and finished[0] is events[-1], f"stream {i}: {len(finished)} terminal events"
        assert ids[-1] == q["output_ids"], f"request {i}: streamed tokens differ from quiet ones"
        assert events[-1]["text"] == q["text"]
    if stack.coalesced:
        # 12 streams at once, every item in a batch, and fewer messages than items
        assert seen["alone"] == 0 and seen["batches"] < seen["batched"], seen
    else:
        assert seen["batches"] == 0 and seen["alone"] >= N * 2, seen


async def test_a_behind_scheduler_sends_fewer_larger_items(stack):
    """The scheduler's loop held up (as a loaded one is) while the executor keeps stepping: the
    waiting steps are taken in together, so the stream has fewer events than tokens, each token in
    order and once."""
    sched = stack.actors["scheduler"]
    real = sched._absorb

    async def slow(step):
        await real(step)
        await asyncio.sleep(0.02)          # the executor steps meanwhile
    sched._absorb = slow
    try:
        events = await sse(stack, body(0, True))
    finally:
        sched._absorb = real
    want = (await quiet(stack, body(0, False)))["output_ids"]
    assert events[-1]["output_ids"] == want
    assert len(events) < len(want)


def out(rid: str, ids: list[int], offset: int, finished: bool = False, lp: bool = False) -> SeqOutput:
    return SeqOutput(rid=rid, token_ids=ids, offset=offset, finished=finished,
                     finish_reason="length" if finished else None, logprobs=[-0.5] * len(ids) if lp else [])


def test_merged_joins_each_requests_consecutive_outputs():
    outs = [("s1", out("a", [1], 0, lp=True)), ("s1", out("b", [7], 3)), ("s2", out("c", [9], 0)),
            ("s1", out("a", [2], 1, lp=True)), ("s1", out("b", [8], 4, finished=True)), ("s1", out("a", [3], 2, lp=True))]
    got = merged(outs)
    assert [(s, o.rid, o.token_ids, o.offset, o.finished) for s, o in got] == [
        ("s1", "a", [1, 2, 3], 0, False), ("s1", "b", [7, 8], 3, True), ("s2", "c", [9], 0, False)]
    assert got[0][1].logprobs == [-0.5] * 3 and got[1][1].finish_reason == "length"


def test_merged_keeps_apart_what_does_not_follow_on():
    # a gap (a lost output's offsets) or an output after a finished one is not joined
    outs = [("s1", out("a", [1], 0)), ("s1", out("a", [5], 4)), ("s1", out("b", [1], 0, finished=True)),
            ("s1", out("b", [2], 1))]
    got = merged(outs)
    assert [(o.rid, o.token_ids, o.offset) for _, o in got] == [("a", [1], 0), ("a", [5], 4), ("b", [1], 0),
                                                               ("b", [2], 1)]
