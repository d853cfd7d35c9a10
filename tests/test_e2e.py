"""End to end through the real services: HTTP -> gateway -> scheduler -> tokenizer -> executor
-> model -> scheduler -> HTTP, over a real nats-server."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from radixflow.services.stack import Stack, stack_config
from radixflow.shared import subjects
from radixflow.shared.bus import Bus
from radixflow.shared.config import BusConfig
from .stacks import wait_healthy
from radixflow.shared.messages import Accepted, GenerateRequest, SamplingParams, StreamChunk


@pytest.fixture(scope="module")
async def stack(nats_server, models):
    cfg = stack_config(nats_server.url, models["tiny-hybrid"], gw_port=0)
    st = await Stack(cfg).start()
    base = f"http://127.0.0.1:{st.actors['gateway'].port}"
    await wait_healthy(base)
    st.base = base
    yield st
    await st.stop()


async def post(base: str, path: str, body, timeout: float = 60):
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.post(base + path, data=data, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text[:1] in "{[" else text)


async def post_sse(base: str, path: str, body) -> list:
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(base + path, json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


async def test_generate_stream_and_not(stack):
    body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    st, r = await post(stack.base, "/generate", body)
    assert st == 200, r
    mi = r["meta_info"]
    assert mi["completion_tokens"] == len(r["output_ids"]) == 8
    assert mi["prompt_tokens"] > 0 and mi["finish_reason"] == {"type": "length", "length": 8}
    events = await post_sse(stack.base, "/generate", body | {"stream": True})
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["text"] == r["text"] and last["output_ids"] == r["output_ids"]
    assert len(events) >= 3          # streamed over several steps, not one blob


async def test_in_process_detokenization_streams_what_the_tokenizer_service_does(stack):
    """The scheduler decodes outputs itself once it has loaded the tokenizer the service names (same
    identity); the streamed deltas are the tokenizer service's, chunk for chunk."""
    sched = stack.actors["scheduler"]
    body = {"text": "Grüße, 世界", "stream": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    await post(stack.base, "/generate", body | {"stream": False})       # names the tokenizer to the scheduler
    for _ in range(300):
        if sched.detok.local is not None:
            break
        await asyncio.sleep(0.1)
    assert sched.detok.local is not None and sched.detok.local.identity
    local = await post_sse(stack.base, "/generate", body)
    tok, sched.detok.local = sched.detok.local, None
    try:
        remote = await post_sse(stack.base, "/generate", body)
    finally:
        sched.detok.local = tok
    chunks = lambda events: [(e["text"], e["output_ids"]) for e in events[:-1]]
    assert chunks(local) == chunks(remote) and local[-2]["text"]


async def test_openai_routes_stream_equals_non_stream(stack):
    st, models = await _get(stack.base, "/v1/models")
    model = models["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, "temperature": 0}
    st, c = await post(stack.base, "/v1/chat/completions", chat)
    assert st == 200 and c["object"] == "chat.completion"
    assert c["usage"]["completion_tokens"] >= 1
    events = await post_sse(stack.base, "/v1/chat/completions", chat | {"stream": True,
                                                                        "stream_options": {"include_usage": True}})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text == c["choices"][0]["message"]["content"]
    assert events[-2]["usage"]["completion_tokens"] == c["usage"]["completion_tokens"]
    comp = {"model": model, "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0}
    st, r = await post(stack.base, "/v1/completions", comp)
    assert st == 200 and r["object"] == "text_completion"
    events = await post_sse(stack.base, "/v1/completions", comp | {"stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == r["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]


async def _get(base, path):
    async with aiohttp.ClientSession() as s:
        async with s.get(base + path) as r:
            return r.status, await r.json()


async def test_sixteen_concurrent_requests(stack):
    bodies = [{"text": f"request number {i}", "sampling_params": {"max_new_tokens": 12, "temperature": 0.7,
                                                                    "seed": i, "ignore_eos": True}} for i in range(16)]
    res = await asyncio.gather(*(post(stack.base, "/generate", b) for b in bodies))
    assert all(st == 200 for st, _ in res), res
    assert all(r["meta_info"]["completion_tokens"] == 12 for _, r in res)
    again = await post(stack.base, "/generate", bodies[3])
    assert again[1]["output_ids"] == res[3][1]["output_ids"]     # seeded: same output alone or in a crowd
    assert stack.actors["executor"].engine.steps < 16 * 12       # decoding was batched


async def test_stop_strings_truncate_and_finish(stack):
    body = {"text": "Stop test prompt", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    _, free = await post(stack.base, "/generate", body)
    text = free["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("degenerate generated text")
    body["sampling_params"]["stop"] = [stop]
    _, r = await post(stack.base, "/generate", body)
    assert r["text"] == text[: text.index(stop)]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


BAD = [
    ("/generate", b"{not json", "not valid JSON"),
    ("/generate", {}, "exactly one of"),
    ("/generate", {"text": 12345}, "Expected `str"),
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 10**9}}, "context length"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_token": 5}}, "unknown field"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"input_ids": [1, 2, 99999999]}, "vocab"),
    ("/generate", {"text": "x " * 40000, "sampling_params": {"max_new_tokens": 4}}, "context length"),
    ("/v1/chat/completions", {"model": "tiny-hybrid", "messages": "nope"}, "Expected `array"),
    ("/v1/chat/completions", {"model": "tiny-hybrid", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny-hybrid", "messages": [{"role": "user", "content": "x"}], "n": 200}, "n must"),
    ("/v1/chat/completions", {"model": "tiny-hybrid", "messages": [{"role": "user", "content": "x"}], "toolz": []},
     "unknown field `toolz`"),
    # tools reach the chat template; a forced call is refused (no tool-call parser makes the model call one)
    ("/v1/chat/completions", {"model": "tiny-hybrid", "messages": [{"role": "user", "content": "x"}],
                              "tools": [], "tool_choice": "required"}, "tool_choice"),
    ("/v1/completions", {"model": "tiny-hybrid", "prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"model": "tiny-hybrid", "prompt": "x", "max_tokens": -1}, "max_new_tokens"),
    ("/v1/completions", {"prompt": "x"}, "model"),
]


@pytest.mark.parametrize("path,body,needle", BAD)
async def test_bad_input_is_a_clear_4xx(stack, path, body, needle):
    st, r = await post(stack.base, path, body)
    assert 400 <= st < 500, (st, r)
    assert isinstance(r, dict) and needle.lower() in r["error"]["message"].lower(), r
    assert r["error"]["code"] == st and r["error"]["type"]


async def test_nats_clients_get_the_same_contract(stack, nats_server):
    """The NATS subjects are a public API: submit and read the stream without HTTP."""
    bus = Bus("test-client", BusConfig(nats_url=nats_server.url))
    await bus.connect()
    async with bus.open_stream(idle_timeout_s=30) as s:
        acc = await bus.request(subjects.SCHEDULER_SUBMIT, GenerateRequest(
            rid="nats-1", stream_subject=s.subject, input_ids=[5, 6, 7, 8],
            sampling=SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)), Accepted)
        items = [i async for i in s]
    assert acc.prompt_tokens == 4
    assert [i.seq for i in items] == list(range(len(items)))
    assert isinstance(items[-1], StreamChunk) and items[-1].finished and items[-1].usage.completion_tokens == 5
    await bus.close()


def test_the_first_stack_to_serve_raises_the_collection_threshold_and_the_last_restores_it(monkeypatch):
    import gc
    from radixflow.services import stack
    monkeypatch.setattr(stack, "_stacks_serving", 0)       # this test's own count (other tests' stacks may serve)
    monkeypatch.setattr(stack, "_gc_before", stack._gc_before)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        stack._gc_serving(+1)
        stack._gc_serving(+1)
        assert gc.get_threshold() == (stack.GC_YOUNG_THRESHOLD, 10, 10)
        stack._gc_serving(-1)
        assert gc.get_threshold() == (stack.GC_YOUNG_THRESHOLD, 10, 10)     # one still serves
        stack._gc_serving(-1)
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)


async def test_startup_objects_are_out_of_the_collectors_sight_while_serving(models):
    """Stack.start freezes what startup made (a full collection walked it all: 163 ms inside a
    burst) and collects the young generation less often (its token-id lists), and Stack.stop hands
    both back, so exit collects as before."""
    import gc
    from radixflow.services.stack import GC_YOUNG_THRESHOLD
    from . import stacks
    before = gc.get_threshold()
    st = await stacks.start(models["tiny-dense"])
    try:
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 10_000
        frozen = gc.get_freeze_count()
        code, r = await post(st.base, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert code == 200, r
        assert gc.get_freeze_count() <= frozen          # serving freezes nothing more (some frozen die)
    finally:
        await stacks.stop(st)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
