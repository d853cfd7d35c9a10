"""`radixflow bench shared-prefix --engine` (bench/shared_prefix.py): the workload's runs on the
Engine alone, in a process of its own (common.EngineHost), cache on and off."""
from __future__ import annotations

from radixflow.services.bench.shared_prefix import _engine_side, _engine_summary, workload


def test_the_engine_alone_computes_what_the_cache_leaves_and_answers_alike(models):
    runs = [workload(96, 8, 4, 4000, seed=s) for s in (3, 4)]
    on = _engine_side(models["tiny-dense"], runs, 2, True, True, "float32")
    off = _engine_side(models["tiny-dense"], runs, 2, False, True, "float32")
    # per run: the first request computes its 96-token preamble (6 full pages) and suffix; the
    # other three reuse the preamble's pages
    assert on["prefill_tokens_computed"] == 96 + 4 * 8
    assert off["prefill_tokens_computed"] == 4 * (96 + 8)
    assert len(on["outputs"]) == 8 and all(len(o) == 2 for o in on["outputs"])
    assert on["outputs"] == off["outputs"]            # greedy: the cache changes no token
    assert len(on["wall_s_runs"]) == 2 and min(on["wall_s_runs"]) <= on["wall_s"] <= max(on["wall_s_runs"])

    served_on = {"wall_s": 2 * on["wall_s"], "floor_s": on["wall_s"] / 2, "prefill_tokens_computed": 128}
    served_off = {"wall_s": off["wall_s"], "floor_s": off["wall_s"], "prefill_tokens_computed": 416}
    outs = on["outputs"][:-1] + [[0, 0]]              # one answer unlike the engine's
    s = _engine_summary({True: on, False: off}, served_on, served_off, outs)
    assert s["prefill_token_ratio"] == 3.25 and s["same_tokens_computed_as_served"]
    assert s["greedy_outputs_identical_to_served"] == "7/8"
    assert s["cache_on"]["served_over_engine"] == 2.0 and s["cache_on"]["wall_over_floor"] == 2.0
    assert s["cache_off"]["served_over_engine"] == 1.0 and s["cache_off"]["wall_over_floor"] == 1.0
