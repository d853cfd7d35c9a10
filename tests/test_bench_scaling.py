"""bench scaling runs its points through a real stack: each point's cache is flushed first, so the
first request computes the preamble and its siblings reuse it (token counts, not times)."""
from radixflow.services.bench.scaling import run_scaling


def test_bench_scaling_points_reuse_their_preamble(models):
    out = run_scaling(models["tiny-dense"], siblings=(3,), preambles=(160, 320))
    rows = out["radixflow"]
    assert [(r["preamble"], r["siblings"]) for r in rows] == [(3000, 3), (160, 40), (320, 40)]
    for r in rows:
        # the preamble once (flushed before the point), the suffixes each; never the preamble again
        assert r["preamble"] <= r["prefill_tokens_computed"] <= r["preamble"] + 16 + r["siblings"] * 116
        assert r["prefix_hit_rate"] > 0
