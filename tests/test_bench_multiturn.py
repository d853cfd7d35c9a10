"""`radixflow bench multiturn` measures what it says: with the tiers on, returning sessions load their
evicted context (fewer prefill tokens computed, a higher hit rate) and answer as without them. Token
counts only; its TTFT ratio is the benchmark's figure (docs/benchmarks.md), not a test's."""
from __future__ import annotations

from radixflow.services.bench.multiturn import MultiturnConfig, run_multiturn


def test_multiturn_tiers_compute_less_and_answer_the_same(models):
    out = run_multiturn(models["tiny-dense"], MultiturnConfig(sessions=4, turns=2, preamble=256, user=32, output=8,
                                                              concurrency=2))
    off, on = out["tiers_off"], out["tiers_on"]
    assert off["prompt_tokens"] == on["prompt_tokens"] > 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert on["prefix_hit_rate"] > off["prefix_hit_rate"]
    # sessions 0 and 1 at least were pushed out by 2 and 3 and load their preambles (15 pages each)
    assert on["tiers"]["loaded_tokens_total"] >= 2 * 240 and off["tiers"] == {}
    assert out["greedy_outputs_identical"] == "8/8"
    assert out["config"]["pool_tokens"] == int(1.25 * 2 * (256 + 2 * 40))
