"""`radixflow bench kernels --interpret`: every kernel runs beside its reference and matches it (the
GPU run's figures are the issue's; on a CPU the interpreter checks the plumbing, not the speed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_kernels_runs_every_op_beside_its_reference(tmp_path):
    env = dict(os.environ, RADIXFLOW_CACHE=str(tmp_path))
    exe = os.path.join(os.path.dirname(sys.executable), "radixflow")
    r = subprocess.run([exe, "bench", "kernels", "--interpret"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    ops = {o["op"]: o for o in out["ops"]}
    assert set(ops) == {"decode_attention", "cascade_decode", "extend_attention", "write_kv", "gated_delta_rule_decode",
                        "gated_delta_rule_prefill", "causal_conv1d_update", "causal_conv1d_prefill"}
    for name, o in ops.items():
        assert o["kernel_ms"] > 0 and o["reference_ms"] > 0, name
        assert o.get("max_abs_diff", 0.0) < 1e-4, name
    assert [e["model"] for e in out["end_to_end_decode"]] == ["tiny-dense", "tiny-hybrid"]
    assert all(e["decode_tok_s_kernels"] > 0 for e in out["end_to_end_decode"])


def test_bench_kernels_without_a_gpu_says_so(tmp_path):
    import pytest
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    exe = os.path.join(os.path.dirname(sys.executable), "radixflow")
    r = subprocess.run([exe, "bench", "kernels"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, RADIXFLOW_CACHE=str(tmp_path)))
    assert r.returncode != 0 and "needs a CUDA device" in r.stderr
