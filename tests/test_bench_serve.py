"""`radixflow bench serve` (bench/serve.py) against a real stack: every request of a level is
counted once, the latency percentiles come from streamed chunks, the agent workload's shared
preambles show up as cache hits, and the curves are drawn."""
from __future__ import annotations

import math

import pytest

from radixflow.services.bench.serve import ServeConfig, plot_curves, summarize, sweep, Result

from . import stacks


@pytest.fixture(scope="module")
async def stack(models):
    st = await stacks.start(models["tiny-dense"])
    yield st
    await stacks.stop(st)


async def test_random_sweep_counts_every_request(stack):
    cfg = ServeConfig(mode="random", levels=(1, 3), requests=5, input_len=16, output_len=4, vocab=4000)
    rows = await sweep(stack.base, cfg, "radixflow", stack.actors["radix"])
    assert [r["level"] for r in rows] == [1, 3]
    for r in rows:
        assert (r["completed"], r["failed"]) == (5, 0), r
        assert r["ttft_ms_p50"] > 0 and r["ttft_ms_p99"] >= r["ttft_ms_p50"]
        assert r["itl_ms_p50"] > 0 and r["e2e_ms_p99"] >= r["ttft_ms_p99"]
        assert r["output_tok_s"] > 0 and 0 < r["peak_kv_pages"] <= r["kv_pages_total"]


async def test_agent_programs_share_their_preambles(stack, tmp_path):
    cfg = ServeConfig(mode="agent", levels=(20,), requests=3, preamble=96, suffix=8, fanout=4, tools=1,
                      output_len=3, vocab=4000)
    rows = await sweep(stack.base, cfg, "radixflow", stack.actors["radix"])
    (r,) = rows
    assert (r["completed"], r["failed"]) == (12, 0), r
    # one tool's preamble (96 tokens) and each program's task are shared by its 4 calls
    assert r["cache_hit_rate"] > 0.3, r
    png = tmp_path / "curves.png"
    out = plot_curves({"model": "tiny-dense", "config": {"mode": "agent"}, "radixflow": rows,
                       "against": {"url": "other", "rows": rows}}, str(png))
    if out.startswith("matplotlib is not installed"):
        pytest.skip(out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_of_failures_and_percentiles():
    rs = [Result(ok=True, prompt_tokens=10, cached_tokens=5, output_tokens=3, ttft=t, itl=[0.01, 0.02], e2e=t + 0.03)
          for t in (0.1, 0.2, 0.3, 0.4)] + [Result(ok=False, error="HTTP 503: x")]
    s = summarize(rs, 2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, ["HTTP 503: x"])
    assert s["ttft_ms_p50"] == 200.0 and s["ttft_ms_p99"] == 400.0 and s["itl_ms_p99"] == 20.0
    assert s["cache_hit_rate"] == 0.5 and s["output_tok_s"] == 6.0
    assert math.isclose(s["request_throughput"], 2.0)


async def test_shared_prefix_against_an_openai_server(stack):
    """bench shared-prefix --against: the agent workload on any OpenAI-compatible server (here
    radixflow's own /v1/completions), its wall time and the prefix hits the server reports."""
    from radixflow.services.bench.shared_prefix import _peer, workload
    runs = [workload(96, 8, 4, 4000, seed=s) for s in (3, 4)]
    out = await _peer(stack.base, runs, 2, first_alone=True)
    assert out["wall_s"] > 0 and len(out["wall_s_runs"]) == 2
    assert min(out["wall_s_runs"]) - 1e-3 <= out["wall_s"] <= max(out["wall_s_runs"]) + 1e-3      # their median
    # per run, the first request computes its preamble; the other three reuse its full pages
    assert 0 < out["prefix_hit_rate"] < 1
    assert 96 <= out["prefill_tokens_computed"] <= 96 + 4 * 8 + 4 * 16


def test_serve_split_layout_runs_both_layouts_on_the_same_load(models):
    """`bench serve --layout split`: two mixed executors, then a prefill and a decode executor, the same
    agent load; the split layout moved pages and every call completed in both (counts, not times)."""
    from radixflow.services.bench.serve import ServeConfig, run_layouts
    cfg = ServeConfig(mode="agent", levels=(4,), requests=2, preamble=256, suffix=32, fanout=3, output_len=8)
    out = run_layouts(models["tiny-dense"], cfg, min_tokens=128, processes=False)
    for side in ("mixed", "split"):
        (row,) = out[side]
        assert row["completed"] == 6 and row["failed"] == 0, row
    assert out["split_moves"]["disagg_prefills_total"] >= 2 and out["split_moves"]["kv_transfer_pages"] >= 2 * 16
    assert set(out["ratios"][0]) == {"level", "itl_p99_split_over_mixed", "ttft_p50_split_over_mixed",
                                     "output_tok_s_split_over_mixed"}
