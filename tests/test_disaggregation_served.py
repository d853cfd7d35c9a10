"""Prefill/decode disaggregation through the services: a prefill executor and a decode executor on one
bus answer as one executor does (greedy), long prompts go through the prefill executor and short
ones do not, the bytes moved are the pages', and a prefill executor that dies mid-way costs a retry
on the decode executor, not the request."""
from __future__ import annotations

import asyncio

import pytest
import torch

from radixflow.services.bench.common import served_executors

from . import stacks

PAGE = 16


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def split(model: str, **over):
    """Every service but the executors, then a prefill executor and a decode executor (with a host
    tier to take pages); prompts with 256 tokens to compute go through the prefill one."""
    return served_executors(model, [{"role": "prefill"}, {"role": "decode", "kv_host_pages": 512}],
                            sc_disagg_min_tokens=256, **over)


async def _gen(http, base: str, ids: list[int], n: int = 8) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    async with http.post(base + "/generate", json=body) as r:
        out = await r.json()
        assert r.status == 200, out
        return out


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
async def test_a_prefill_and_a_decode_executor_answer_as_one(models, preset):
    prompts = [_prompt(i, 300 + 37 * i) for i in range(4)] + [_prompt(9, 100)]      # the last one is short
    st = await stacks.start(models[preset])
    try:
        want = [await _gen(st.http, st.base, p) for p in prompts]
    finally:
        await stacks.stop(st)
    async with split(models[preset]) as (stack, http, base, (pre, dec)):
        got = [await _gen(http, base, p) for p in prompts[:2]]
        got += list(await asyncio.gather(*(_gen(http, base, p) for p in prompts[2:])))
        sent, recv = pre.transfer_counters, dec.transfer_counters
        sched = stack.actors["scheduler"]
        assert sched.disagg_counters == {"disagg_prefills_total": 4, "disagg_prefill_failed_total": 0}
        pages = sum((len(p) - 1) // PAGE for p in prompts[:4])
        spec = dec.engine.spec
        page_bytes = 2 * len(spec.attn_layers) * PAGE * spec.num_kv_heads * spec.head_dim * 4
        state_bytes = recv["kv_transfer_bytes_received_total"] - pages * page_bytes
        assert sent["kv_transfer_pages_sent_total"] == recv["kv_transfer_pages_received_total"] == pages
        assert sent["kv_transfer_bytes_sent_total"] == recv["kv_transfer_bytes_received_total"]
        if preset == "tiny-dense":
            assert state_bytes == 0                                   # exactly the pages' bytes
        else:
            assert state_bytes > 0 and state_bytes % 4 == 0           # and one state per prompt
        # the decode executor computed only what follows the moved pages; the short prompt went there alone
        assert dec.engine.counters["prefill_tokens_computed_total"] == \
            sum(len(p) - (len(p) - 1) // PAGE * PAGE for p in prompts[:4]) + len(prompts[4])
        assert pre.engine.counters["requests_total"] == 4
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["meta_info"]["cached_tokens"] for g in got[:4]] == [(len(p) - 1) // PAGE * PAGE for p in prompts[:4]]


async def test_a_prefill_executor_that_dies_costs_a_retry_not_the_request(models):
    """The prefill executor stops answering mid-way (its bus closed under it, as a kill leaves it):
    requests whose prefill stage it held are decoded (prompt computed) on the decode executor, each
    with one answer, equal to one executor's."""
    prompts = [_prompt(20 + i, 400) for i in range(3)]
    st = await stacks.start(models["tiny-dense"])
    try:
        want = [await _gen(st.http, st.base, p) for p in prompts]
    finally:
        await stacks.stop(st)
    async with split(models["tiny-dense"], sc_executor_timeout_s=1.0) as (stack, http, base, (pre, _)):
        tasks = [asyncio.create_task(_gen(http, base, p)) for p in prompts]
        await asyncio.sleep(0.05)
        await pre.bus.close()              # no more outputs, pages or heartbeats from it
        got = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        sched = stack.actors["scheduler"]
        assert sched.disagg_counters["disagg_prefill_failed_total"] + sched.disagg_counters["disagg_prefills_total"] == 3
        assert sched.disagg_counters["disagg_prefill_failed_total"] >= 1
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


async def test_a_decode_executor_that_dies_mid_transfer_ends_each_request_once(models):
    """The decode executor stops answering while prompts are on their way to it: every request ends
    exactly once (an answer, from the prefill executor taking it, or one clear error), nothing hangs,
    and the prefill executor's pool is left with no page held by a request."""
    prompts = [_prompt(40 + i, 400) for i in range(3)]
    async with split(models["tiny-dense"], sc_executor_timeout_s=1.0) as (stack, http, base, (pre, dec)):
        async def one(p):
            body = {"input_ids": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
            async with http.post(base + "/generate", json=body) as r:
                return r.status, await r.json()
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.05)
        await dec.bus.close()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for status, out in outs:
            assert status == 200 and len(out["output_ids"]) == 8 or status >= 500 and "error" in out, (status, out)
        for _ in range(100):               # the last releases reach radix with the next exchange
            occ = (await (await http.get(base + "/v1/memory")).json())["executors"]
            mine = [e["occupancy"] for e in occ if e["instance"] == pre.instance]
            if mine and mine[0].get("kv_pages_private", 0) == 0 and mine[0].get("requests_held", 0) == 0:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"pages still held on the prefill executor: {mine}")
