"""`radixflow bench schemas`: four schemas through the real stack; the result's counts add up, no
returned output is invalid, and a broken schema is refused as such."""
from __future__ import annotations

import json

from radixflow.services.bench.schemas import (SAMPLE_OUTCOMES, SchemasBenchConfig, bench_schemas, format_table,
                                              refusal_reason, summarize)

SCHEMAS = {
    "simple": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["ok", "n"], "additionalProperties": False},
    "negation": {"type": "object", "properties": {"a": {"not": {"type": "null"}}}, "required": ["a"]},
    "unique": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                                         "maxItems": 3, "uniqueItems": True}},
               "required": ["tags"], "additionalProperties": False},
    "broken": {"type": "object", "properties": {"a": {"type": 12}}},
}


async def test_bench_schemas_counts_add_up(models, tmp_path):
    for name, schema in SCHEMAS.items():
        (tmp_path / f"t__{name}.json").write_text(json.dumps(schema))
    cfg = SchemasBenchConfig(max_tokens=256, samples=2, timeout_s=60)
    out = await bench_schemas(models["tiny-hybrid"], str(tmp_path), cfg)
    s, recs = out["summary"], {r["name"]: r for r in out["schemas"]}
    assert set(recs) == {f"t__{n}" for n in SCHEMAS}
    assert s["schemas"] == 4 == s["accepted"] + s["refused"] + s["error"]
    assert set(s["samples"]) == set(SAMPLE_OUTCOMES)
    assert sum(s["samples"].values()) == s["accepted"] * cfg.samples
    assert sum(s["refusals"].values()) == s["refused"]
    assert s["samples"]["invalid"] == 0, [r["samples"] for r in out["schemas"]]
    assert s["error"] == 0 and s["samples"]["error"] == 0, s["errors"]

    simple = recs["t__simple"]
    assert simple["status"] == "accepted" and simple["probe_s"] > 0
    assert [x["outcome"] for x in simple["samples"]] == ["valid", "valid"]
    # the grammar service's own compile time, next to the probe's wall time (which includes it)
    assert 0 < simple["compile_s"] <= simple["probe_s"]
    assert s["compile_s"][simple["backend"]]["n"] >= 1 and s["probe_s"][simple["backend"]]["n"] >= 1
    assert all(r["compile_s"] is not None for r in recs.values() if r["status"] == "accepted")
    assert 0 < out["probes_wall_s"] <= out["wall_s"]
    broken = recs["t__broken"]
    assert broken["status"] == "refused" and broken["reason"] == "invalid schema", broken
    json.dumps(out)       # what --json writes


def test_summary_and_table_show_both_compile_figures():
    recs = [{"name": "a", "status": "accepted", "backend": "xgrammar", "probe_s": 0.2, "compile_s": 0.1, "samples": [],
             "reason": None},
            {"name": "b", "status": "accepted", "backend": "xgrammar", "probe_s": 0.05, "compile_s": 0.0, "samples": [],
             "reason": None},
            {"name": "c", "status": "refused", "backend": None, "probe_s": 0.01, "compile_s": None, "samples": [],
             "reason": "invalid schema"}]
    s = summarize(recs)
    assert s["compile_s"]["xgrammar"] == {"n": 2, "p50": 0.0, "p99": 0.1, "max": 0.1, "cache_hits": 1}
    assert s["probe_s"]["xgrammar"]["max"] == 0.2
    table = format_table(s)
    assert "compile" in table and "probe" in table and "xgrammar" in table


def test_refusal_reasons_are_short_buckets():
    assert refusal_reason("unsupported JSON Schema construct 'uniqueItems' at $.tags: xgrammar ignores it") \
        == "construct uniqueItems (ignored)"
    assert refusal_reason("unsupported JSON Schema construct 'type' at $.a: keywords beside 'oneOf' are ignored") \
        == "construct type (beside oneOf)"
    assert refusal_reason("compiling this grammar took longer than 10s; simplify it") == "compile timeout"
    assert refusal_reason("the compiled grammar is 9.1 MiB compressed, over the 8.0 MiB limit") == "blob too large"
    assert refusal_reason("invalid JSON Schema at $.properties.a: 12 is not valid") == "invalid schema"
    assert refusal_reason("something 'odd' happened at 12 places") == "something '_' happened at N places"
