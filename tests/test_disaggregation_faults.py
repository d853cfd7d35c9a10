"""Disaggregation under real faults: every service in its own OS process, executor 0 a prefill
executor and executor 1 a decode executor with a host tier, every prompt long enough to go through
the prefill one. kill -9 of either with 32 long-prompt streams in flight (prefill stages, page moves
and decodes under way) leaves every accepted request with exactly one terminal event, the pools idle
once the killed one is back, and the cluster serving."""
from __future__ import annotations

import signal

import pytest

from radixflow.services.cluster import ClusterConfig
from radixflow.shared.natsd import free_port

from .faults import FAST_FAILURE_ENV, assert_every_stream_ended_once, assert_idle_and_serving, burst, serving

pytestmark = pytest.mark.distributed

# ~300 tokens: 18 whole pages move per request
PROMPT = "Write the history of the harbour town. " + " ".join(
    f"Chapter {i} tells of the {w} that came by sea and what the town made of it." for i, w in
    enumerate(["salt", "timber", "wool", "spice", "coal", "tea", "glass", "iron", "silk", "grain", "wine", "paper"]))


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    cfg = ClusterConfig(model=models["tiny-dense"], port=free_port(), counts={"executor": 2},
                        log_dir=str(tmp_path_factory.mktemp("disagg-logs")),
                        env=FAST_FAILURE_ENV | {"RADIXFLOW_SCHEDULER_DISAGG_MIN_TOKENS": "64"},
                        label_env={"executor-0": {"RADIXFLOW_EXECUTOR_ROLE": "prefill"},
                                   "executor-1": {"RADIXFLOW_EXECUTOR_ROLE": "decode",
                                                  "RADIXFLOW_EXECUTOR_KV_HOST_PAGES": "2048"}},
                        args=("--max-total-tokens", "65536"))
    with serving(cfg) as c:
        yield c


def _moved(c) -> int:
    import urllib.request
    with urllib.request.urlopen(c.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("radixflow_kv_transfer_pages_received_total"))


def test_requests_go_through_the_prefill_executor(cluster):
    outs, _ = burst(cluster, None, n=4, max_tokens=8, prompt=PROMPT)
    assert [o["end"] for o in outs] == ["done"] * 4
    assert _moved(cluster) >= 4 * 16


@pytest.mark.parametrize("index", [0, 1], ids=["prefill", "decode"])
def test_kill_9_either_executor_mid_transfer(cluster, index):
    assert_idle_and_serving(cluster)
    outs, struck = burst(cluster, lambda: cluster.signal("executor", signal.SIGKILL, index=index), after_s=1.0,
                         max_tokens=64, prompt=PROMPT)
    assert_every_stream_ended_once(outs, struck)
    if index == 0:        # a lost prefill stage is a retry on the decode executor: every request finishes
        assert all(o["end"] == "done" for o in outs), [o["end"] for o in outs]
    assert_idle_and_serving(cluster)
