"""The public NATS API with plain nats-py clients: JSON (by header) and msgpack, sequence numbers
and one terminal item, typed errors, n > 1 on one stream; and the client example of docs/api.md runs."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys

import msgspec
import nats
import pytest

from .stacks import start, stop

README = os.path.join(os.path.dirname(__file__), "..", "docs", "api.md")
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
async def server(models):
    st = await start(models["tiny-dense"])
    st.nc = await nats.connect(st.nats.url)
    yield st
    await st.nc.close()
    await stop(st)


async def read_stream(sub, decode) -> list[dict]:
    items = []
    while True:
        item = decode((await sub.next_msg(timeout=60)).data)
        items.append(item)
        if item["type"] == "StreamError" or item.get("finished"):
            return items


@pytest.mark.parametrize("codec", ["json", "msgpack"])
async def test_submit_and_stream(server, codec):
    nc = server.nc
    enc, dec, headers = ((lambda o: json.dumps(o).encode(), json.loads, JSON) if codec == "json"
                         else (msgspec.msgpack.encode, msgspec.msgpack.decode, None))
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = {"type": "GenerateRequest", "rid": f"nats-{codec}", "stream_subject": inbox, "text": "The sky is",
           "sampling": {"max_new_tokens": 5, "temperature": 0, "logprobs": True}}
    acc = dec((await nc.request("rf.scheduler.submit", enc(req), headers=headers, timeout=30)).data)
    assert acc["type"] == "Accepted" and acc["rid"] == req["rid"] and acc["prompt_tokens"] > 0
    items = await read_stream(sub, dec)
    assert [i["seq"] for i in items] == list(range(len(items)))
    assert items[-1]["type"] == "StreamChunk" and items[-1]["finished"] and items[-1]["finish_reason"] == "length"
    assert sum(len(i.get("token_ids", [])) for i in items) == 5 == sum(len(i.get("logprobs", [])) for i in items)
    await sub.unsubscribe()


async def test_typed_errors_and_n(server):
    nc = server.nc
    bad = json.loads((await nc.request("rf.scheduler.submit", json.dumps(
        {"rid": "x", "stream_subject": "_INBOX.x", "text": "hi", "sampling": {"temperature": -1}}).encode(),
        headers=JSON, timeout=10)).data)
    assert bad["type"] == "ErrorReply" and bad["code"] == 400 and bad["param"] == "temperature"
    junk = json.loads((await nc.request("rf.scheduler.submit", b"{not json", headers=JSON, timeout=10)).data)
    assert junk["type"] == "ErrorReply" and junk["code"] == 400
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = {"rid": "nats-n", "stream_subject": inbox, "text": "Three ways:", "n": 3,
           "sampling": {"max_new_tokens": 4, "temperature": 1.0, "seed": 4}}
    acc = json.loads((await nc.request("rf.scheduler.submit", json.dumps(req).encode(), headers=JSON, timeout=30)).data)
    assert acc["type"] == "Accepted"
    items = await read_stream(sub, json.loads)
    assert [i["seq"] for i in items] == list(range(len(items)))
    assert sum(1 for i in items if i.get("finished")) == 1 and items[-1]["finished"]
    ends = {i.get("index", 0) for i in items if i.get("finish_reason")}
    assert ends == {0, 1, 2}
    assert {i.get("index", 0): sum(len(j.get("token_ids", [])) for j in items if j.get("index", 0) == i.get("index", 0))
            for i in items} == {0: 4, 1: 4, 2: 4}


async def test_readme_client_runs(server):
    code = re.search(r"```python\n# radixflow NATS client example\n(.*?)```", open(README).read(), re.S).group(1)
    code = code.replace("nats://127.0.0.1:4222", server.nats.url)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().strip().splitlines()
    assert "'type': 'Accepted'" in lines[0] and lines[-1].endswith("length"), lines
