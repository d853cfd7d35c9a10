"""Programs end to end, through the real services over a real nats-server: a parent computed once
and pinned while its children wait, hybrid children resuming exactly at the fork point, cancel,
failure propagation, joins, select against the model's own likelihood, streaming, the NATS API."""
from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest

from radixflow.shared import subjects
from radixflow.shared.bus import Bus
from radixflow.shared.config import BusConfig
from radixflow.shared.messages import (NodeGen, ProgramAccepted, ProgramEvent, ProgramInfo, ProgramNode, ProgramQuery,
                                       ProgramRequest)

from .stacks import start, stop

SCHEMA = {"type": "object", "properties": {"tool": {"type": "string", "enum": ["search", "calc", "none"]},
                                           "arg": {"type": "string", "maxLength": 12}},
          "required": ["tool", "arg"], "additionalProperties": False}
rng = random.Random(11)
PRE = [rng.randint(300, 3999) for _ in range(640)]            # 40 pages of 16: the fork point is on a boundary
SUFS = [[rng.randint(300, 3999) for _ in range(37)] for _ in range(6)]


@pytest.fixture(scope="module")
async def dense(models):
    st = await start(models["tiny-dense"])
    yield st
    await stop(st)


@pytest.fixture(scope="module")
async def hybrid(models):
    st = await start(models["tiny-hybrid"])
    yield st
    await stop(st)


async def run(st, nodes, **extra):
    async with st.http.post(st.base + "/v1/programs", json={"nodes": nodes} | extra) as r:
        body = await r.json()
        return r.status, body


async def events(st, nodes, on_event=None):
    out = []
    async with st.http.post(st.base + "/v1/programs", json={"nodes": nodes, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                ev = line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
                out.append(ev)
                if on_event is not None and ev != "[DONE]":
                    await on_event(ev)
    return out


def pool(st):
    return next(iter(st.actors["radix"].pools.values()))


async def settled(st, key: str, value) -> dict:
    """Pool stats once `key` reaches `value`: unpins and aborts reach radix with the executor's next step."""
    for _ in range(100):
        stats = pool(st).stats()
        if stats[key] == value:
            break
        await asyncio.sleep(0.02)
    return stats


def computed(res: dict) -> int:
    return sum(v["meta_info"]["prompt_tokens"] - v["meta_info"]["cached_tokens"] for v in res["nodes"].values())


def fanout(n: int, schema: bool = True) -> list[dict]:
    gen = {"max_tokens": 48, "temperature": 0.7, "seed": 3} | ({"json_schema": SCHEMA} if schema else {})
    return [{"id": "pre", "input_ids": PRE}] + [{"id": f"q{i}", "parent": "pre", "input_ids": SUFS[i], "gen": gen}
                                                for i in range(n)]


async def test_fanout_computes_the_parent_once_and_outputs_validate(dense):
    p = pool(dense)
    p.flush()
    status, res = await run(dense, fanout(6))
    assert status == 200, res
    assert res["state"] == "finished"
    assert res["nodes"]["pre"]["meta_info"]["cached_tokens"] == 0
    for i in range(6):
        q = res["nodes"][f"q{i}"]
        assert q["state"] == "done"
        assert q["meta_info"]["cached_tokens"] == len(PRE)          # the parent's KV existed before its prefill
        jsonschema.validate(json.loads(q["output"]), SCHEMA)
    assert computed(res) == len(PRE) + sum(len(s) for s in SUFS)
    assert (await settled(dense, "pins", 0))["pins"] == 0           # released once the children were admitted


async def test_hybrid_children_resume_at_the_fork_point(hybrid):
    p = pool(hybrid)
    p.flush()
    before = dict(p.counters)
    status, res = await run(hybrid, fanout(4, schema=False))
    assert status == 200, res
    for i in range(4):
        assert res["nodes"][f"q{i}"]["meta_info"]["cached_tokens"] == len(PRE)
    assert computed(res) == len(PRE) + sum(len(s) for s in SUFS[:4])    # the preamble once, not twice
    assert p.counters["state_restores_total"] - before["state_restores_total"] == 4
    assert p.counters["state_recomputed_tokens_total"] == before["state_recomputed_tokens_total"]
    assert len(PRE) in p.tree.checkpoints_on("default", PRE)


async def test_pinned_parent_survives_eviction_while_children_wait(models):
    """The parent's child waits on a slow node; other traffic meanwhile needs more pages than are free.
    Without the pin the parent (the least recently used) would be evicted and recomputed."""
    st = await start(models["tiny-dense"], ex_max_total_tokens=2048)
    try:
        nodes = [{"id": "pre", "input_ids": PRE},
                 {"id": "slow", "input_ids": [5, 6, 7], "gen": {"max_tokens": 600, "ignore_eos": True, "temperature": 0}},
                 {"id": "child", "parent": "pre", "after": ["slow"], "input_ids": SUFS[0], "gen": {"max_tokens": 4}}]
        seen = {}
        flood = [[rng.randint(300, 3999) for _ in range(300)] for _ in range(4)]

        async def on_event(ev):
            if ev["event"] == "finished" and ev["node"] == "pre":
                for ids in flood:
                    async with st.http.post(st.base + "/generate", json={"input_ids": ids, "sampling_params": {
                            "max_new_tokens": 2}}) as r:
                        assert r.status == 200
                seen["pinned"] = pool(st).stats()["kv_pages_pinned"]
                seen["evicted"] = pool(st).counters["evicted_pages_total"]
        evs = await events(st, nodes, on_event)
        done = evs[-2]
        assert done["event"] == "done" and done["state"] == "finished"
        assert seen["pinned"] == len(PRE) // 16 and seen["evicted"] > 0     # pressure was real, the pin held
        assert done["nodes"]["child"]["meta_info"]["cached_tokens"] == len(PRE)
        stats = await settled(st, "pins", 0)
        assert stats["pins"] == 0 and stats["kv_pages_pinned"] == 0
        assert stats["kv_pages_evictable"] == stats["kv_pages_cached"]       # evictable again after
    finally:
        await stop(st)


async def test_cancel_a_node_ends_it_and_its_dependents_and_frees_pages(dense):
    nodes = [{"id": "long", "input_ids": SUFS[1], "gen": {"max_tokens": 3000, "ignore_eos": True}},
             {"id": "after_long", "parent": "long", "text": " and then", "gen": {"max_tokens": 4}},
             {"id": "other", "input_ids": SUFS[2], "gen": {"max_tokens": 4, "temperature": 0}}]
    replies = {}

    async def on_event(ev):
        if ev["event"] == "delta" and ev["node"] == "long" and "cancel" not in replies:
            replies["cancel"] = None
            async with dense.http.delete(f"{dense.base}/v1/programs/{ev['id']}/nodes/long") as r:
                replies["cancel"] = (r.status, await r.json())
    evs = await events(dense, nodes, on_event)
    status, dag = replies["cancel"]
    assert status == 200
    by_id = {n["id"]: n for n in dag["nodes"]}
    assert by_id["long"]["state"] == "cancelled"
    assert by_id["after_long"]["state"] == "cancelled"
    assert by_id["after_long"]["error"]["message"] == "dependency 'long' was cancelled"
    done = evs[-2]
    assert done["nodes"]["other"]["state"] == "done" and done["nodes"]["long"]["meta_info"]["completion_tokens"] < 3000
    stats = await settled(dense, "requests_held", 0)
    assert stats["requests_held"] == 0 and stats["kv_pages_private"] == 0
    async with dense.http.get(f"{dense.base}/v1/programs/{done['id']}") as r:
        assert r.status == 200 and (await r.json())["state"] == "finished"


async def test_a_failing_node_fails_its_dependents_and_the_rest_returns(dense):
    nodes = [{"id": "root", "text": "Once upon a time"},
             {"id": "cut", "parent": "root", "gen": {"max_tokens": 1, "json_schema": SCHEMA}},   # cannot complete
             {"id": "next", "parent": "cut", "gen": {"max_tokens": 3}},
             {"id": "join", "after": ["cut", "ok"], "text": "{cut} / {ok}", "gen": {"max_tokens": 3}},
             {"id": "ok", "parent": "root", "gen": {"max_tokens": 5, "temperature": 0}}]
    status, res = await run(dense, nodes)
    assert status == 200, res
    n = res["nodes"]
    assert n["cut"]["state"] == "failed" and "max_tokens" in n["cut"]["error"]["message"]
    assert n["next"]["state"] == "failed" and n["next"]["error"]["message"].startswith("dependency 'cut' failed: ")
    assert n["join"]["state"] == "failed"
    assert n["ok"]["state"] == "done" and n["ok"]["meta_info"]["completion_tokens"] == 5


async def test_join_substitutes_outputs(dense):
    nodes = [{"id": "a", "text": "Alpha", "gen": {"max_tokens": 4, "temperature": 0}},
             {"id": "b", "text": "Beta", "gen": {"max_tokens": 4, "temperature": 0}},
             {"id": "j", "after": ["a", "b"], "text": "First: {a}. Second: {b}. {not_a_node}", "gen": {"max_tokens": 2}}]
    status, res = await run(dense, nodes)
    assert status == 200, res
    n = res["nodes"]
    assert n["j"]["text"] == f"First: {n['a']['output']}. Second: {n['b']['output']}. {{not_a_node}}"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(dense.cfg.executor.model)
    assert n["j"]["meta_info"]["prompt_tokens"] == len(tok.encode(n["j"]["text"], add_special_tokens=False))


async def test_select_follows_the_models_likelihood(dense):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = dense.cfg.executor.model
    tok = AutoTokenizer.from_pretrained(path)
    choices = [" search the web", " calculate", " answer directly", " none"]
    nodes = [{"id": "ctx", "input_ids": PRE[:100]},
             {"id": "pick", "parent": "ctx", "text": "\nNext step:", "select": {"choices": choices}},
             {"id": "go", "parent": "pick", "gen": {"max_tokens": 3, "temperature": 0}}]
    status, res = await run(dense, nodes)
    assert status == 200, res
    pick = res["nodes"]["pick"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = PRE[:100] + tok.encode("\nNext step:", add_special_tokens=False)
    want = []
    for c in choices:
        ids = tok.encode(c, add_special_tokens=False)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
        want.append(sum(logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(ids)) / len(ids))
    assert pick["meta_info"]["scores"] == pytest.approx(want, abs=2e-3)
    best = max(range(len(want)), key=lambda i: want[i])
    assert pick["output"] == choices[best]
    assert res["nodes"]["go"]["meta_info"]["prompt_tokens"] == len(prompt) + len(tok.encode(choices[best],
                                                                                             add_special_tokens=False))


async def test_speculative_drafts_lose_a_select(dense):
    nodes = [{"id": "q", "input_ids": PRE[:64]}] + \
            [{"id": f"d{i}", "parent": "q", "gen": {"max_tokens": 6, "temperature": 1.0, "seed": i}, "speculative": True}
             for i in range(3)] + \
            [{"id": "keep", "parent": "q", "after": ["d0", "d1", "d2"], "text": " Best:",
              "select": {"choices": ["{d0}", "{d1}", "{d2}"]}}]
    status, res = await run(dense, nodes)
    assert status == 200, res
    n = res["nodes"]
    winner = [i for i in range(3) if n[f"d{i}"]["output"] == n["keep"]["output"]]
    assert winner
    assert sum(bool(n[f"d{i}"].get("discarded")) for i in range(3)) == 2 - (len(winner) - 1)


async def test_program_stream_events(dense):
    evs = await events(dense, [{"id": "a", "text": "Hello", "gen": {"max_tokens": 6, "temperature": 0,
                                                                   "ignore_eos": True}},
                               {"id": "b", "parent": "a", "text": "!", "gen": {"max_tokens": 2}}])
    assert evs[-1] == "[DONE]" and evs[-2]["event"] == "done"
    kinds = [(e["event"], e.get("node")) for e in evs[:-2]]
    assert kinds[0] == ("started", "a") and ("finished", "a") in kinds
    assert kinds.index(("finished", "a")) < kinds.index(("started", "b"))
    deltas = "".join(e["text"] for e in evs if isinstance(e, dict) and e["event"] == "delta" and e["node"] == "a")
    assert deltas == evs[-2]["nodes"]["a"]["output"]


async def test_bad_programs_are_400(dense):
    status, body = await run(dense, [{"id": "a", "text": "x", "parent": "b"}, {"id": "b", "text": "y", "parent": "a"}])
    assert status == 400 and "dependency cycle" in body["error"]["message"]
    status, body = await run(dense, [{"id": "a", "text": "x", "gen": {"max_tokens": 4, "json_schema": {"type": "nope"}}}])
    assert status == 400 and "node 'a'" in body["error"]["message"]
    status, body = await run(dense, [{"id": "a", "text": "x", "bogus": 1}])
    assert status == 400 and "bogus" in body["error"]["message"]
    async with dense.http.get(dense.base + "/v1/programs/nope") as r:
        assert r.status == 404


async def test_program_over_nats(dense):
    bus = Bus("test-program-client", BusConfig(nats_url=dense.nats.url))
    await bus.connect()
    try:
        async with bus.open_stream(idle_timeout_s=60) as stream:
            req = ProgramRequest(id="nats-prog", stream_subject=stream.subject, nodes=[
                ProgramNode(id="p", input_ids=PRE[:32]),
                ProgramNode(id="c", parent="p", input_ids=[7, 8], gen=NodeGen(max_tokens=3))])
            acc = await bus.request(subjects.SCHEDULER_PROGRAM, req, ProgramAccepted, timeout=30)
            got = [ev async for ev in stream]
        assert isinstance(got[-1], ProgramEvent) and got[-1].finished and got[-1].status == "finished"
        finished = {e.node: e.result for e in got if e.kind == "finished"}
        assert finished["c"].state == "done" and finished["c"].completion_tokens == 3
        info = await bus.request(subjects.program_op(acc.scheduler, "get"), ProgramQuery(id="nats-prog"), ProgramInfo)
        assert [n.state for n in info.nodes] == ["done", "done"]
        info = await bus.request(subjects.PROGRAM_GET, ProgramQuery(id="nats-prog"), ProgramInfo)
        assert info.id == "nats-prog"
    finally:
        await bus.close()


async def test_program_metrics(dense):
    async with dense.http.get(dense.base + "/metrics") as r:
        text = await r.text()
    names = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("radixflow_programs_total", "radixflow_program_nodes_total", "radixflow_programs_running",
                 "radixflow_program_parent_prefills_saved_total", "radixflow_kv_pages_pinned"):
        assert name in names
    saved = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("radixflow_program_parent_prefills_saved_total"))
    assert saved >= 6        # the fan-out's six children at least


async def test_the_program_deadline_fails_what_is_unfinished(dense):
    nodes = [{"id": "quick", "input_ids": SUFS[3], "gen": {"max_tokens": 2}},
             {"id": "endless", "input_ids": SUFS[4], "gen": {"max_tokens": 20000, "ignore_eos": True}},
             {"id": "after", "parent": "endless", "gen": {"max_tokens": 2}}]
    status, res = await run(dense, nodes, timeout=1.5)
    assert status == 200, res
    n = res["nodes"]
    assert res["state"] == "timeout" and n["quick"]["state"] == "done"
    assert n["endless"]["state"] == "failed" and n["endless"]["error"]["code"] == 504
    assert n["after"]["state"] == "failed"


async def test_cancel_the_whole_program(dense):
    nodes = [{"id": "a", "input_ids": SUFS[5], "gen": {"max_tokens": 3000, "ignore_eos": True}},
             {"id": "b", "parent": "a", "gen": {"max_tokens": 2}}]
    replies = {}

    async def on_event(ev):
        if ev["event"] == "delta" and "cancel" not in replies:
            replies["cancel"] = None
            async with dense.http.delete(f"{dense.base}/v1/programs/{ev['id']}") as r:
                replies["cancel"] = (r.status, await r.json())
    evs = await events(dense, nodes, on_event)
    assert replies["cancel"][0] == 200 and replies["cancel"][1]["state"] == "cancelled"
    assert evs[-2]["state"] == "cancelled"
    assert {k: v["state"] for k, v in evs[-2]["nodes"].items()} == {"a": "cancelled", "b": "cancelled"}


async def test_children_run_on_the_executor_holding_their_parent(models):
    from radixflow.services.stack import build
    st = await start(models["tiny-dense"])
    bus = Bus("second-executor", BusConfig(nats_url=st.nats.url))
    await bus.connect()
    second = build("executor", bus, st.cfg)
    await second.start()
    try:
        sched = st.actors["scheduler"]
        for _ in range(100):
            if len(sched.executors) == 2:
                break
            await asyncio.sleep(0.1)
        assert len(sched.executors) == 2
        homes = set()

        def program():
            pre = [rng.randint(300, 3999) for _ in range(64)]
            return [{"id": "pre", "input_ids": pre}] + [
                {"id": f"c{i}", "parent": "pre", "input_ids": SUFS[i][:8], "gen": {"max_tokens": 2}} for i in range(4)] + [
                {"id": "g", "parent": "c0", "gen": {"max_tokens": 2}}]
        # several programs at once, different preambles: placed by load over both executors
        for status, res in await asyncio.gather(*(run(st, program()) for _ in range(6))):
            assert status == 200, res
            used = {v["executor"] for v in res["nodes"].values()}
            assert len(used) == 1, used
            homes |= used
            assert all(res["nodes"][f"c{i}"]["meta_info"]["cached_tokens"] == 64 for i in range(4))
        assert len(homes) == 2
    finally:
        await second.drain()
        await second.stop()
        await bus.close()
        await stop(st)
