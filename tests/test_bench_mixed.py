"""bench mixed measures what it says: decoding requests get tokens during a burst's prefill only
with mixed steps (counts, not times: wall-clock thresholds would flake on a loaded machine)."""
from radixflow.services.bench.mixed import run_mixed


def test_bench_mixed_counts_decode_tokens_during_prefill(models):
    out = run_mixed(models["tiny-dense"], decoding=4, burst=2, prompt_len=600, rounds=1, mixed_chunk_tokens=256)
    assert out["mixed"]["decode_tokens_during_prefill"] > 0 and out["mixed"]["mixed_steps"] > 0
    assert out["unmixed"]["decode_tokens_during_prefill"] == 0 and out["unmixed"]["mixed_steps"] == 0
    assert out["itl_max_unmixed_over_mixed"] > 0
