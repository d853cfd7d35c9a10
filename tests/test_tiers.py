"""KV tiers (services/executor/tiers.py) on the engine: a workload larger than the device pool computes
fewer prefill tokens with host and disk tiers than without and answers the same; what a tier loads
equals what the model computes (dense and hybrid); no tier crosses a cache namespace; a disk file
that is missing, truncated or corrupt is computed again, never served."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.shared.messages import ExecRequest, SamplingParams

PAGE = 16


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 8000, (n,), generator=g).tolist()


PREAMBLES = [_tokens(100 + i, 160) for i in range(4)]


def _engine(model: str, host: int = 0, disk: str = "", disk_pages: int = 0, tokens: int = 512, **kw) -> Engine:
    """A device pool of `tokens` slots: about two preambles and their requests."""
    return Engine(EngineConfig(model=model, page_size=PAGE, max_total_tokens=tokens, max_running_requests=4,
                               warmup_tokens=0, kv_host_pages=host, kv_disk_dir=disk, kv_disk_pages=disk_pages,
                               decode_reserve=0, **kw))


def _run(engine: Engine, prompts: list[tuple[str, list[int], str]], n: int = 6,
         logprobs: bool = False) -> dict[str, tuple[list[int], list[float], int]]:
    """One request at a time (each after the one before has ended): rid -> (tokens, logprobs, cached)."""
    out = {}
    for rid, ids, ns in prompts:
        engine.add(ExecRequest(rid=rid, input_ids=ids, eos_token_ids=[], namespace=ns,
                               sampling=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                                       logprobs=logprobs)))
        toks, lps, cached = [], [], 0
        while engine.has_work():
            for _, o in engine.step():
                toks += o.token_ids
                lps += o.logprobs
                cached = max(cached, o.cached_tokens)
        out[rid] = (toks, lps, cached)
    return out


def _cycling(rounds: int = 3, ns: str = "default") -> list[tuple[str, list[int], str]]:
    """Several preambles in turn, each with a new question: more than the pool holds at once."""
    return [(f"r{r}-p{i}", p + _tokens(1000 * r + i, 20), ns) for r in range(rounds) for i, p in enumerate(PREAMBLES)]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_a_workload_larger_than_the_pool_computes_less_with_tiers_and_answers_the_same(models, preset):
    work = _cycling()
    off = _engine(models[preset])
    want = _run(off, work, logprobs=True)
    tiered = _engine(models[preset], host=256)
    got = _run(tiered, work, logprobs=True)
    assert [v[0] for v in got.values()] == [v[0] for v in want.values()]
    for (_, a, _), (_, b, _) in zip(got.values(), want.values()):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    st, base = tiered.stats(), off.stats()
    # the first round computes every preamble; later rounds find them in the host tier (the pool
    # holds two at most): each later request computes little more than its own 20 tokens
    assert base["cached_tokens_total"] < 160 * 2
    # (hybrid: a state is kept only where a checkpoint was planned, so round 1's states are at its
    # prompts' ends; round 2 asks for one where the tier's pages end, round 3 resumes there)
    loading = ["r1", "r2"] if preset == "tiny-dense" else ["r2"]
    assert st["tier_loaded_tokens_total"] >= len(loading) * 4 * 144, st
    assert st["prefill_tokens_computed_total"] < base["prefill_tokens_computed_total"] - len(loading) * 4 * 128
    later = [v[2] for k, v in got.items() if k[:2] in loading]
    assert all(c >= 144 for c in later), later                  # usage counts a tier's tokens as cached
    if preset == "tiny-hybrid":
        assert st["tier_saved_states_total"] > 0


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_a_tier_load_equals_recompute(models, preset):
    """The pages (and state) loaded from the tier give the logits a full computation gives: the
    loaded request's prompt logprobs equal those of a cache-off engine."""
    eng = _engine(models[preset], host=256)
    target = PREAMBLES[0] + _tokens(7, 30)
    _run(eng, [("warm", PREAMBLES[0] + _tokens(8, 5), "default")])
    _run(eng, [(f"push{i}", p + _tokens(9, 5), "default") for i, p in enumerate(PREAMBLES[1:])])   # out of the pool
    before = eng.stats()["tier_loaded_tokens_total"]
    # prompt logprobs from just past the preamble (its state at 160 is in the tier): 160 tokens may load
    eng.add(ExecRequest(rid="t", input_ids=target, eos_token_ids=[], logprob_start=161,
                        sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)))
    got = _drain(eng)
    assert eng.stats()["tier_loaded_tokens_total"] - before >= 144
    ref = _engine(models[preset], disable_radix_cache=True)
    ref.add(ExecRequest(rid="t", input_ids=target, eos_token_ids=[], logprob_start=161,
                        sampling=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)))
    want = _drain(ref)
    assert got["tokens"] == want["tokens"]
    torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]), atol=1e-4, rtol=0)
    # the prompt's own logprobs after the loaded part come from the loaded KV, all that were asked for
    assert len(got["input"]) == len(want["input"]) == len(target) - 161
    torch.testing.assert_close(torch.tensor(got["input"]), torch.tensor(want["input"]), atol=1e-4, rtol=0)


def _drain(eng: Engine) -> dict:
    out = {"tokens": [], "logprobs": [], "input": []}
    while eng.has_work():
        for _, o in eng.step():
            out["tokens"] += o.token_ids
            out["logprobs"] += o.logprobs
            if o.finished:
                out["input"] = list(o.input_logprobs)
    return out


def test_prompt_logprobs_from_the_start_load_nothing_and_come_whole(models):
    eng = _engine(models["tiny-dense"], host=256)
    _run(eng, _cycling(rounds=1))
    before = eng.stats()["tier_loaded_tokens_total"]
    ids = PREAMBLES[0] + _tokens(11, 12)
    eng.add(ExecRequest(rid="lp", input_ids=ids, eos_token_ids=[], logprob_start=0,
                        sampling=SamplingParams(max_new_tokens=1, temperature=0.0)))
    got = _drain(eng)
    assert eng.stats()["tier_loaded_tokens_total"] == before and len(got["input"]) == len(ids) - 1


def test_one_save_of_more_pages_than_the_host_tier_holds_keeps_the_last_and_right_ones(models):
    """A grant reusing more keyed pages than the host tier has slots: the most recent fit, each slot
    holding its own key's page; a key two device pages hold is saved once."""
    from radixflow.services.executor.memory import KVPool, MemoryPlan
    from radixflow.services.executor.models import ModelSpec
    from radixflow.services.executor.tiers import KVTiers
    spec = ModelSpec.from_dir(models["tiny-dense"])
    kv = KVPool(spec, MemoryPlan(page_size=PAGE, num_pages=16, num_state_slots=0, kv_dtype=torch.float32,
                                 state_dtype=torch.float32), torch.device("cpu"))
    for t in kv.k + kv.v:
        t.copy_(torch.arange(16).repeat_interleave(PAGE)[:, None, None].float().expand_as(t))   # page p holds p
    tiers = KVTiers(kv, None, host_pages=8)
    keys = {p: bytes([p]) * 16 for p in range(12)}
    tiers.page_key.update(keys)
    tiers.page_key[12] = keys[11]                     # page 12 holds what page 11 does
    tiers.reused(list(range(13)))
    assert len(tiers.host.index) == 8 and sorted(tiers.host.index.values()) == list(range(8))
    for key, slot in tiers.host.index.items():
        page = key[0]
        assert page >= 4                              # the last 8 distinct keys: pages 4..11
        assert torch.all(tiers.host.store[0][slot] == page) and torch.all(tiers.host.store[1][slot] == page)


def test_no_tier_crosses_a_cache_namespace(models):
    eng = _engine(models["tiny-dense"], host=256)
    _run(eng, _cycling(rounds=1, ns="alpha"))
    loaded = eng.stats()["tier_loaded_tokens_total"]
    beta = _run(eng, [("b", PREAMBLES[0] + _tokens(5, 20), "beta")])
    assert eng.stats()["tier_loaded_tokens_total"] == loaded and beta["b"][2] == 0
    alpha = _run(eng, [("a", PREAMBLES[0] + _tokens(5, 20), "alpha")])
    assert eng.stats()["tier_loaded_tokens_total"] > loaded and alpha["a"][2] >= 144
    assert alpha["a"][0] == beta["b"][0]


def test_a_bad_disk_file_is_computed_again_not_served(models, tmp_path):
    """Host tier of 12 pages over a disk tier: the preambles spill to files. One preamble's third
    page file truncated, another's first with a flipped byte, a third's sixth deleted: loading stops
    there and the rest is computed (the bad files dropped); the answers equal those of an engine
    without tiers."""
    from radixflow.shared.page_keys import chain
    disk = tmp_path / "kv"
    eng = _engine(models["tiny-dense"], host=12, disk=str(disk), disk_pages=512)
    _run(eng, _cycling(rounds=1))
    _run(eng, [(f"push{i}", _tokens(50 + i, 170), "default") for i in range(3)])   # preambles down to disk
    assert eng.stats()["tier_spilled_pages_total"] > 20

    def page_file(preamble: int, page: int) -> Path:
        key = chain(eng.tiers.root, list(b"default"))
        for i in range(page + 1):
            key = chain(key, PREAMBLES[preamble][i * PAGE:(i + 1) * PAGE])
        return disk / (key.hex() + ".kv")
    bad = [page_file(0, 2), page_file(1, 0), page_file(2, 5)]
    assert all(f.exists() for f in bad)
    raw = bad[0].read_bytes()
    bad[0].write_bytes(raw[: len(raw) // 2])
    raw = bytearray(bad[1].read_bytes())
    raw[-7] ^= 0xFF
    bad[1].write_bytes(bytes(raw))
    os.unlink(bad[2])
    again = [(f"again{i}", p + _tokens(77, 20), "default") for i, p in enumerate(PREAMBLES[:3])]
    got = _run(eng, again)
    want = _run(_engine(models["tiny-dense"]), again)
    assert [v[0] for v in got.values()] == [v[0] for v in want.values()]
    st = eng.stats()
    assert st["tier_disk_corrupt_total"] == 3, st
    assert [v[2] for v in got.values()] == [2 * PAGE, 0, 5 * PAGE]     # loaded up to the bad page
    assert not any(f.exists() for f in bad)


def test_disk_files_outlive_the_engine(models, tmp_path):
    """A new engine on the same model and directory finds the pages an earlier one spilled."""
    disk = str(tmp_path / "kv")
    eng = _engine(models["tiny-dense"], host=4, disk=disk, disk_pages=512)
    _run(eng, _cycling(rounds=1))
    _run(eng, [(f"push{i}", _tokens(50 + i, 170), "default") for i in range(3)])
    del eng
    fresh = _engine(models["tiny-dense"], host=64, disk=disk, disk_pages=512)
    got = _run(fresh, [("x", PREAMBLES[0] + _tokens(3, 20), "default")])
    assert fresh.stats()["tier_disk_hit_pages_total"] >= 9 and got["x"][2] >= 144


async def test_tiers_served_and_reported(models):
    """Through the stack (`radixflow up --kv-host-pages`): later rounds of the cycling preambles come
    back from the host tier (meta_info.cached_tokens counts them), and /metrics and /v1/memory report
    each tier's occupancy and hit rate; radix's placement counts what the tier holds."""
    from . import stacks
    from .test_radix_e2e import metrics
    st = await stacks.start(models["tiny-dense"], ex_max_total_tokens=512, ex_kv_host_pages=256,
                            ex_decode_reserve=0)
    try:
        cached = {}
        for rid, ids, _ in _cycling(rounds=2):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
            async with st.http.post(st.base + "/generate", json=body) as r:
                out = await r.json()
                assert r.status == 200, out
            cached[rid] = out["meta_info"]["cached_tokens"]
        assert all(c >= 144 for rid, c in cached.items() if rid.startswith("r1")), cached
        m = await metrics(st)
        assert m["radixflow_tier_loaded_tokens_total"] >= 4 * 144
        assert m["radixflow_tier_host_pages_used"] > 0 and m["radixflow_tier_host_pages_total"] == 256
        assert m["radixflow_tier_hit_rate_permille"] > 0
        async with st.http.get(st.base + "/v1/memory") as r:
            mem = await r.json()
        tiers = mem["executors"][0]["tiers"]
        assert tiers["host_pages_used"] > 0 and tiers["disk_pages_total"] == 0 and tiers["loaded_tokens_total"] > 0
        # radix learned what the host tier holds over the bus: its placement answer counts it, and is
        # what the request then gets
        from radixflow.shared import subjects
        from radixflow.shared.messages import RadixPlace, RadixPlaceReply
        (pool_id, pool), = st.actors["radix"].pools.items()
        ns = next(iter(pool.tree.roots))
        ids = PREAMBLES[0] + _tokens(4242, 20)
        place = await st.actors["scheduler"].bus.request(
            subjects.RADIX_PLACE, RadixPlace(namespace=ns, token_ids=ids, pools=[pool_id]), RadixPlaceReply)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        async with st.http.post(st.base + "/generate", json=body) as r:
            out = await r.json()
        assert place.tier_tokens[pool_id] >= 144 and place.cached_tokens[pool_id] == out["meta_info"]["cached_tokens"]
        assert m["radixflow_tier_pages_known"] > 0
    finally:
        await stacks.stop(st)


def _settled(eng: Engine) -> None:
    import time
    deadline = time.monotonic() + 60
    while eng.tiers.prefetcher.pending() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_pages_on_disk_are_read_ahead_of_admission_off_the_compute_thread(models, tmp_path, preset):
    """A request whose preamble went down to disk: while it waits (the engine has not stepped), the
    prefetch thread reads its page files (and hybrid states) into the host tier, so its admission loads
    from host memory and reads no file; a corrupt file met there is dropped and its tokens computed.
    The answers equal those of an engine without tiers."""
    from radixflow.shared.page_keys import chain
    disk = tmp_path / "kv"
    eng = _engine(models[preset], host=24, disk=str(disk), disk_pages=512)
    # hybrid: the second round asks for checkpoints where the tiers' pages end (known_boundary)
    _run(eng, _cycling(rounds=1 if preset == "tiny-dense" else 2))
    _run(eng, [(f"push{i}", _tokens(50 + i, 170), "default") for i in range(4)])   # preambles down to disk
    key = chain(eng.tiers.root, list(b"default"))
    for i in range(5):
        key = chain(key, PREAMBLES[1][i * PAGE:(i + 1) * PAGE])
    bad = disk / (key.hex() + ".kv")                                             # preamble 1's fifth page
    raw = bytearray(bad.read_bytes())
    raw[-3] ^= 0xFF
    bad.write_bytes(bytes(raw))
    before = eng.stats()
    again = [(f"again{i}", p + _tokens(88, 20), "default") for i, p in enumerate(PREAMBLES[:2])]
    got = {}
    for rid, ids, ns in again:
        eng.add(ExecRequest(rid=rid, input_ids=ids, eos_token_ids=[], namespace=ns,
                            sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)))
        _settled(eng)                          # what the wait before admission lets the thread do
        toks, cached = [], 0
        while eng.has_work():
            for _, o in eng.step():
                toks += o.token_ids
                cached = max(cached, o.cached_tokens)
        got[rid] = (toks, cached)
    st = eng.stats()
    want = _run(_engine(models[preset]), again)
    assert [v[0] for v in got.values()] == [v[0] for v in want.values()]
    assert st["tier_disk_read_at_admission_pages_total"] == before["tier_disk_read_at_admission_pages_total"]
    assert st["tier_prefetched_pages_total"] - before["tier_prefetched_pages_total"] >= 10 + 4
    assert st["tier_disk_corrupt_total"] == 1 and not bad.exists()
    assert got["again1"][1] <= 4 * PAGE                   # loaded at most up to the bad page
    if preset == "tiny-dense":
        assert got["again0"][1] >= 10 * PAGE and got["again1"][1] == 4 * PAGE
        assert st["tier_disk_hit_pages_total"] - before["tier_disk_hit_pages_total"] >= 14
    else:
        assert st["tier_prefetched_states_total"] > before["tier_prefetched_states_total"] and got["again0"][1] > 0


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_radix_knows_what_the_tiers_hold_and_places_by_it(models, preset):
    """The executor reports the keys its tiers gain and lose with its RadixStep; the radix pool's
    placement (RadixPlace) then counts what a prompt would load from the tiers after its device match,
    and that is what the request gets. Nothing crosses a namespace; a radix that forgot (a restart)
    is told everything again."""
    eng = _engine(models[preset], host=64)
    _run(eng, _cycling(rounds=1 if preset == "tiny-dense" else 2))
    pool = eng.pages.pool
    st = eng.stats()
    assert pool.stats()["tier_pages_known"] == st["tier_host_pages_used"] > 0
    tiered = 0
    for i, p in enumerate(PREAMBLES):
        ids = p + _tokens(999 + i, 20)
        dev, tier = pool.placement("default", ids)
        assert pool.placement("elsewhere", ids) == (0, 0)
        got = _run(eng, [(f"q{i}", ids, "default")])
        assert got[f"q{i}"][2] == dev + tier, (i, dev, tier)
        tiered += tier
    assert tiered >= 2 * 9 * PAGE                  # at least two preambles came back from the host tier
    eng.pages.register(eng._register)              # a radix that knows nothing of this pool
    eng.tiers.report_all()
    while eng.has_work():
        eng.step()
    assert eng.pages.pool.stats()["tier_pages_known"] == eng.stats()["tier_host_pages_used"]


def test_tier_index_counts_the_run_a_load_would_take():
    """TierIndex (radix): a dense prompt loads the run of its pages the tiers hold from its device
    match on, never its last token's page; a hybrid one only up to the deepest page whose state a
    tier holds; dropped keys count no more."""
    from radixflow.services.radix.tiered import TierIndex
    from radixflow.shared.messages import RadixStep
    from radixflow.shared.page_keys import PageKeys
    root, ids = b"r" * 16, _tokens(5, 6 * PAGE + 3)
    ks = PageKeys(root, "ns", ids, PAGE).upto(6)
    dense, hybrid = TierIndex(root, PAGE, False), TierIndex(root, PAGE, True)
    for t in (dense, hybrid):
        t.apply(RadixStep(pool="p", budget=0, max_admit=0, tier_pages_added=ks[1:6], tier_states_added=[ks[3]]))
    assert dense.loadable("ns", ids, 0) == 0                  # page 0 is in no tier: nothing after it loads
    assert dense.loadable("ns", ids, PAGE) == 5 * PAGE
    assert dense.loadable("ns", ids[:4 * PAGE + 1], PAGE) == 3 * PAGE     # the last token's page is computed
    assert hybrid.loadable("ns", ids, PAGE) == 3 * PAGE       # to the state after page 3
    assert dense.loadable("other", ids, PAGE) == 0
    dense.apply(RadixStep(pool="p", budget=0, max_admit=0, tier_pages_dropped=[ks[3]]))
    assert dense.loadable("ns", ids, PAGE) == 2 * PAGE
    capped = TierIndex(root, PAGE, False, max_pages=2)         # a load takes at most 2 pages there
    capped.apply(RadixStep(pool="p", budget=0, max_admit=0, tier_pages_added=ks))
    assert capped.loadable("ns", ids, PAGE) == 2 * PAGE


def test_pages_moved_in_keep_the_earlier_pages_radix_counted_here(models):
    """Disaggregation moves only the pages after what radix counted on the decode executor, its tier
    included: storing them must not push that tier's earlier pages of the same prompt out (they are
    made recent first), or the load would stop at the gap and compute what was moved."""
    from radixflow.shared.page_keys import PageKeys
    eng = _engine(models["tiny-dense"], host=8)
    tiers = eng.tiers
    shape, dtype = tiers.page_shape(), eng.runner.kv.k[0].dtype
    pages = lambda n: torch.randn(n, *shape).to(dtype)     # noqa: E731
    ids, other = _tokens(11, 8 * PAGE), _tokens(12, 8 * PAGE)
    tiers.put("default", ids, 0, pages(3), pages(3))        # this prompt's first three pages
    tiers.put("default", other, 0, pages(4), pages(4))      # another prompt's, more recent
    tiers.put("default", ids, 3, pages(4), pages(4))        # the rest of this prompt arrives: 1 slot free
    ks = PageKeys(tiers.root, "default", ids, PAGE).upto(7)
    assert all(k in tiers.host.index for k in ks)


def _one(eng: Engine, rid: str, ids: list[int]) -> int:
    return _run(eng, [(rid, ids, "default")], n=2)[rid][2]


@pytest.mark.parametrize("case", ["host-only", "host-over-disk"])
def test_placement_counts_what_the_load_then_takes(models, tmp_path, case):
    """Where placement and the load could part: a host tier too small for the whole run (the load
    takes all but one host slot; placement is capped alike), and a grant whose saves would push the
    request's own run out of a host-only tier before its load (the run is made recent first, and
    what is saved is what fits beside it)."""
    if case == "host-only":
        eng, pre, pushes = _engine(models["tiny-dense"], host=40), _tokens(1, 160), 2
    else:
        eng, pre, pushes = _engine(models["tiny-dense"], host=4, disk=str(tmp_path / "kv"), disk_pages=512), \
            _tokens(1, 320), 4
    _one(eng, "a", pre + _tokens(2, 10))
    for i in range(pushes):
        _one(eng, f"push{i}", _tokens(50 + i, 300))
    ids = pre + _tokens(3, 300 if case == "host-only" else 10)
    dev, tier = eng.pages.pool.placement("default", ids)
    assert tier > 0 and _one(eng, "b", ids) == dev + tier


def test_an_idle_executor_does_not_spin_on_a_tier_report_while_radix_is_down(models):
    """Tier changes go to radix even when nothing runs, but not while radix does not answer: the
    loop would retry as fast as it can. The heartbeat's sync() brings the report when radix is back."""
    from radixflow.services.executor.pages import LocalPages
    from radixflow.shared.errors import ServiceUnavailable

    class Flaky(LocalPages):
        down = False

        def step(self, msg):
            if self.down:
                raise ServiceUnavailable("no service answers")
            return super().step(msg)
    eng = Engine(EngineConfig(model=models["tiny-dense"], page_size=PAGE, max_total_tokens=256, max_running_requests=4,
                              warmup_tokens=0, kv_host_pages=64, decode_reserve=0, radix_wait_s=0.2), pages=Flaky())
    _run(eng, [(f"r{i}", _tokens(i, 100), "default") for i in range(3)])
    assert not eng.has_work() and eng.stats()["tier_host_pages_used"] > 0
    eng.pages.down = True
    eng.tiers.report_all()                   # changes radix has not heard of
    assert eng.has_work()
    eng.step()                               # the report fails: radix is down
    assert eng.tiers.pending() and not eng.has_work()
    eng.pages.down = False
    eng.sync()                               # radix beats again
    while eng.has_work():
        eng.step()
    assert not eng.tiers.pending()
    assert eng.pages.pool.stats()["tier_pages_known"] == eng.stats()["tier_host_pages_used"]
