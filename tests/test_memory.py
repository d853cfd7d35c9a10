"""The memory calculator reproduces the architecture notes' figures; the server reports what it
allocated."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import aiohttp

from radixflow.services.executor.memory import estimate
from radixflow.services.executor.models.spec import ModelSpec
from radixflow.services.modelgen.presets import QWEN35_27B


def test_reference_numbers():
    e = estimate(ModelSpec.from_config(QWEN35_27B), "bfloat16", prefix_tokens=3000, copies=40)
    assert e["kv_bytes_per_token"] == 64 * 1024                      # 16 x 2 x 4 x 256 x 2 B
    assert e["prefix_kv_bytes"] == 187.5 * 2**20
    assert round(e["copies_kv_bytes"] / 2**30, 2) == 7.32
    assert e["recurrent_state_bytes_per_sequence"] == 144 * 2**20  # 48 x 48 x 128 x 128 x 4 B
    assert e["state_bytes_per_sequence"] == 144 * 2**20 + 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2


def test_cli_calculator(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN35_27B))
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "radixflow"), "memory", str(cfg),
                          "--prefix-tokens", "3000", "--copies", "40", "--json"], capture_output=True, text=True)
    got = json.loads(out.stdout)
    assert got["kv_bytes_per_token"] == 65536 and got["prefix_kv_bytes"] == 196608000
    assert got["copies_kv_bytes"] == 7864320000 and got["recurrent_state_bytes_per_sequence"] == 150994944


async def test_server_reports_realized_memory(nats_server, models):
    from radixflow.services.stack import Stack, stack_config
    st = await Stack(stack_config(nats_server.url, models["tiny-hybrid"], gw_port=0, ex_state_slots=40)).start()
    try:
        base = f"http://127.0.0.1:{st.actors['gateway'].port}"
        async with aiohttp.ClientSession() as s, s.get(base + "/v1/memory") as r:
            body = await r.json()
        ex = body["executors"][0]
        # tiny-hybrid: one attention layer of 2 KV heads x 64 in fp32; three DeltaNet layers
        assert ex["kv_bytes_per_token"] == 1 * 2 * 2 * 64 * 4 and ex["kv_dtype"] == "float32"
        assert ex["recurrent_state_bytes_per_sequence"] == 3 * 4 * 64 * 64 * 4
        assert ex["conv_state_bytes_per_sequence"] == 3 * (2 * 2 * 64 + 4 * 64) * 3 * 4
        assert ex["state_slots"] == 40 and ex["state_pool_bytes"] == 40 * ex["state_bytes_per_sequence"]
        assert ex["occupancy"]["state_slots_total"] == 40 and ex["occupancy"]["kv_pages_total"] == ex["kv_pages"]
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
            text = await r.text()
        for name in ("state_slots_used", "state_slots_total", "state_checkpoints_total", "state_restores_total",
                     "state_recomputed_tokens_total"):
            assert f"radixflow_{name}{{" in text, name
    finally:
        await st.stop()


def test_pools_sized_from_free_memory(models):
    """mem_fraction: the KV pool (with the state slots) takes that share of the free memory, less
    the weights; a share too small for one max_model_len sequence is a clear error."""
    import pytest
    import torch

    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.services.executor.memory import free_bytes, realized, tokens_for
    spec = ModelSpec.from_dir(models["tiny-hybrid"])
    per_token = estimate(spec, torch.float32)["kv_bytes_per_token"]
    state = estimate(spec, torch.float32)["state_bytes_per_sequence"]
    assert tokens_for(spec, 1000 * per_token + 3 * state, torch.float32, 3) == 1000
    assert tokens_for(spec, 10 * state, torch.float32, 20) == 0

    free = free_bytes(torch.device("cpu"))
    frac = min(0.05, (2 << 30) / free)              # at most ~2 GiB of KV on the test machine
    e = Engine(EngineConfig(model=models["tiny-hybrid"], mem_fraction=frac, max_model_len=4096))
    r = realized(e.spec, e.runner.plan)
    used = r["kv_pool_bytes"] + r["state_pool_bytes"]
    assert 0.5 * frac * free < used <= frac * free * 1.01
    with pytest.raises(ValueError, match="mem_fraction"):
        Engine(EngineConfig(model=models["tiny-hybrid"], mem_fraction=1e-6))


def test_state_copies_batched_as_one_after_the_other(models):
    """StatePool.copy_many / reset_many (a step's checkpoints and restores, one gather and scatter
    per layer tensor) leave the pool as copy / reset one by one would, also where order matters
    (a destination that is another pair's source, or written twice: then it copies one by one)."""
    import torch
    from radixflow.services.executor.memory import MemoryPlan, StatePool
    spec = ModelSpec.from_dir(models["tiny-hybrid"])
    plan = MemoryPlan(page_size=16, num_pages=4, num_state_slots=12, kv_dtype=torch.float32, state_dtype=torch.float32)
    for pairs in ([(0, 5), (1, 6), (2, 7)], [(0, 5), (5, 6)], [(0, 5), (1, 5)], [(3, 4)], []):
        a, b = StatePool(spec, plan, torch.device("cpu")), StatePool(spec, plan, torch.device("cpu"))
        for t, u in zip(a.recurrent + a.conv, b.recurrent + b.conv):
            u.copy_(t.copy_(torch.randn_like(t)))
        a.copy_many(pairs)
        a.reset_many([9, 10])
        for s, d in pairs:
            b.copy(s, d)
        b.reset(9)
        b.reset(10)
        assert all(torch.equal(t, u) for t, u in zip(a.recurrent + a.conv, b.recurrent + b.conv)), pairs
