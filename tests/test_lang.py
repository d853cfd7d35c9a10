"""radixflow.lang: tracing builds the DAG the server runs; value-dependent flow runs step by step;
the examples of docs/programs.md run against a live server, over HTTP and over NATS."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from radixflow.lang import NatsRuntime, ProgramResult, Runtime, function, gen, select
from radixflow.lang.eager import EagerState

from .stacks import start, stop

README = os.path.join(os.path.dirname(__file__), "..", "docs", "programs.md")
SCHEMA = {"type": "object", "properties": {"tool": {"type": "string", "enum": ["search", "calc", "none"]},
                                           "arg": {"type": "string", "maxLength": 12}}, "required": ["tool", "arg"]}


@function
def combined(s, topic):
    s += f"Topic: {topic}.\n" * 12
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Idea {i}:" + gen("idea", max_tokens=8, temperature=0)
    forks.join()
    s += "\nBest:" + select("best", choices=s["idea"])
    s += "\nJSON:" + gen("call", max_tokens=48, json_schema=SCHEMA)


def test_trace_builds_one_dag():
    nodes, state, _ = combined.trace(topic="caches")
    by = {n["id"]: n for n in nodes}
    root, i0, i1, best, call = nodes
    assert root["text"] == "Topic: caches.\n" * 12 and "gen" not in root and "parent" not in root   # a prefill-only parent
    assert i0["parent"] == i1["parent"] == root["id"] and i0["text"] == "Idea 0:"
    assert best["parent"] == root["id"] and set(best["after"]) == {i0["id"], i1["id"]}
    assert best["select"]["choices"] == ["{" + i0["id"] + "}", "{" + i1["id"] + "}"]
    assert call["parent"] == best["id"] and call["gen"]["json_schema"] == SCHEMA
    assert len(by) == 5 and state["idea"][0].node == i0["id"]


def test_value_dependent_flow_cannot_be_traced():
    @function
    def branchy(s):
        s += "Q" + gen("x", max_tokens=2)
        if s["x"] == "yes":
            s += "y"
    with pytest.raises(Exception) as e:
        branchy.trace()
    assert "generated at run time" in str(e.value)


def test_text_with_values_becomes_a_join():
    @function
    def mr(s):
        s += "Docs\n"
        parts = s.fork(2, speculative=True)
        for p in parts:
            p += gen("sum", max_tokens=3)
        parts.join()
        s += "All: " + ", ".join(s["sum"]) + gen("all", max_tokens=3)
    nodes, _, _ = mr.trace()
    last = nodes[-1]
    a, b = nodes[1]["id"], nodes[2]["id"]
    assert last["text"] == f"All: {{{a}}}, {{{b}}}" and last["after"] == [a, b]
    assert nodes[1]["speculative"] and "speculative" not in last


@pytest.fixture(scope="module")
def server(models):
    import asyncio
    loop = asyncio.new_event_loop()
    st = loop.run_until_complete(start(models["tiny-dense"]))
    import threading
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield st
    asyncio.run_coroutine_threadsafe(stop(st), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def test_fork_join_select_and_schema_return_the_expected_structure(server):
    out = combined.run(topic="caches", backend=Runtime(server.base))
    assert isinstance(out, ProgramResult)
    ideas = out["idea"]
    assert len(ideas) == 2 and all(isinstance(x, str) for x in ideas)
    assert out["best"] in ideas
    jsonschema.validate(json.loads(out["call"]), SCHEMA)
    text = out.text()
    assert text.startswith("Topic: caches.\n" * 12) and text.endswith(out["call"]) and out["best"] in text
    assert [m["cached_tokens"] > 0 for m in out.meta_info("idea")] == [True, True]


def test_run_batch(server):
    outs = combined.run_batch([{"topic": "pages"}, {"topic": "trees"}, {"topic": "bus"}], backend=Runtime(server.base))
    assert [o.text().startswith(f"Topic: {t}.") for o, t in zip(outs, ["pages", "trees", "bus"])] == [True] * 3
    for o in outs:
        jsonschema.validate(json.loads(o["call"]), SCHEMA)


def _examples() -> dict[str, str]:
    text = open(README).read()
    return dict(re.findall(r"```python\n# radixflow\.lang example: (\w+)\n(.*?)```", text, re.S))


def test_readme_has_the_examples():
    assert set(_examples()) == {"agent", "tree", "mapreduce", "speculative", "branch"}


@pytest.mark.parametrize("name", ["agent", "tree", "mapreduce", "speculative", "branch"])
def test_readme_example_runs(server, name, capsys):
    ns: dict = {}
    exec(_examples()[name].replace("http://127.0.0.1:8000", server.base), ns)
    if name == "agent":
        calls = ns["out"]["call"]
        assert len(calls) == 3
        for c in calls:
            json.loads(c)
        assert all(m["cached_tokens"] > 0 for m in ns["out"].meta_info("call"))
    elif name == "tree":
        tree = ns["tree"]
        assert isinstance(tree, ProgramResult) and tree["best2"] in tree["thought"]
        assert len([n for n in tree.nodes.values() if n["kind"] == "select"]) == 3
    elif name == "mapreduce":
        mr = ns["mr"]
        join = [n for n in mr.nodes.values() if n["text"].startswith("Summaries:")][0]
        assert all(f"- {x}" in join["text"] for x in mr["summary"]) and isinstance(mr["combined"], str)
    elif name == "speculative":
        pick = ns["pick"]
        assert pick["chosen"] in pick["draft"]
        assert sum(bool(n.get("discarded")) for n in pick.nodes.values()) >= 1
    else:
        routed = ns["routed"]
        assert isinstance(routed, EagerState) and routed["need"] in ("yes", "no")
        assert ("Tool call:" in routed.text()) == (routed["need"] == "yes")
    assert capsys.readouterr().out


def test_nats_backend(server):
    backend = NatsRuntime(server.nats.url)
    try:
        out = combined.run(topic="queues", backend=backend)
        assert out["best"] in out["idea"]
        jsonschema.validate(json.loads(out["call"]), SCHEMA)
    finally:
        backend.close()
