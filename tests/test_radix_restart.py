"""A restarted radix service forgets every pool; the executors' running requests go on: each
executor registers again with what they hold, and nothing leaks (issue 13)."""
from __future__ import annotations

import msgspec
import pytest

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.radix.pool import PagePool
from radixflow.shared.messages import Candidate, HeldPages, Progress, RadixStep, Release

from .test_engine import no_leak, prompt, req, run


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def engine(request, models):
    return Engine(EngineConfig(model=models[request.param], page_size=16, max_total_tokens=16384,
                               max_running_requests=8, max_prefill_tokens=256, overlap=False))


def _grant(pool, rid, toks, computed):
    g = pool.step(RadixStep(pool="p", budget=100, max_admit=4, candidates=[
        Candidate(rid=rid, namespace="n", token_ids=toks, reserve=4)])).grants[0]
    pool.step(RadixStep(pool="p", budget=100, max_admit=4, progress=[Progress(rid=rid, computed=computed)]))
    return g


def _held(rid, toks, g, computed):
    return HeldPages(rid=rid, namespace="n", tokens=toks, pages=g.pages, computed=computed, state_slot=g.state_slot,
                     tail_slot=g.tail_slot, checkpoints=g.checkpoints, checkpoint_slots=g.checkpoint_slots)


def _idle(pool) -> bool:
    st = pool.stats()
    return (st["requests_held"] == 0 and st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"]
            and st.get("state_slots_used", 0) == st.get("state_slots_cached", 0))


def test_adopt_takes_the_held_pages_and_caches_their_prefixes():
    old = PagePool(64, 4)
    a, b = [5] * 10 + [6, 7], [5] * 10 + [8, 9]          # share two pages and a half
    ga = _grant(old, "a", a, len(a))
    gb = _grant(old, "b", b, 9)
    assert gb.pages[:2] == ga.pages[:2]                  # b reuses a's first two pages
    new = PagePool(64, 4)
    new.adopt([_held("a", a, ga, len(a) + 2), _held("b", b, gb, 9)])
    assert new.free_pages == 64 - len(set(ga.pages) | set(gb.pages))
    assert new.tree.cached_pages == 3 and new.tree.evictable_pages == 0   # a's three pages, locked while they run
    assert new.match_len("n", a + [1]) == 12
    for rid, n in (("a", len(a) + 2), ("b", 9)):
        new.step(RadixStep(pool="p", budget=0, max_admit=0, releases=[Release(rid=rid, output_ids=[1, 2], computed=n)]))
    assert _idle(new)


def test_adopt_in_a_hybrid_pool_keeps_slots_and_resumes_only_from_new_checkpoints():
    old = PagePool(64, 4, num_state_slots=8)
    a = list(range(3, 15))
    ga = _grant(old, "a", a, len(a))                     # its planned checkpoint at 12 is computed
    assert ga.checkpoints == [12]
    new = PagePool(64, 4, num_state_slots=8)
    new.adopt([_held("a", a, ga, len(a))])
    st = new.stats()
    # the checkpoint behind it is not taken back (its slot may be another request's by now): only
    # the working and tail slots are held, and the prefix is cached without a state
    assert st["state_slots_used"] == 2 and st["state_slots_cached"] == 0
    assert new.match_len("n", a + [1]) == 0
    new.step(RadixStep(pool="p", budget=0, max_admit=0, releases=[Release(rid="a", output_ids=[5], computed=len(a),
                                                                          tail=12)]))
    assert _idle(new) and new.match_len("n", a + [1]) == 12   # its tail at release is a checkpoint again


def test_adopt_does_not_claim_a_checkpoint_slot_twice():
    """The old pool freed a computed checkpoint's slot (its node had a state already) and granted
    it to another request: after the restart both report it, and it must be held once, by the
    request still using it."""
    new = PagePool(64, 4, num_state_slots=8)
    a = HeldPages(rid="a", namespace="n", tokens=list(range(3, 15)), pages=[0, 1, 2, 3], computed=12,
                  state_slot=0, tail_slot=1, checkpoints=[12], checkpoint_slots=[5])
    b = HeldPages(rid="b", namespace="n", tokens=list(range(30, 42)), pages=[4, 5, 6, 7], computed=4,
                  state_slot=5, tail_slot=6, checkpoints=[12], checkpoint_slots=[7])
    new.adopt([a, b])
    st = new.stats()
    assert st["state_slots_used"] == 5 and st["state_slots_cached"] == 0     # 0, 1, 5, 6 and b's planned 7
    for rid, n in (("a", 12), ("b", 12)):
        new.step(RadixStep(pool="p", budget=0, max_admit=0, progress=[Progress(rid=rid, computed=n)]))
        new.step(RadixStep(pool="p", budget=0, max_admit=0, releases=[Release(rid=rid, output_ids=[], computed=n)]))
    assert _idle(new)


def test_a_candidate_asked_again_after_a_lost_grant_does_not_leak():
    pool = PagePool(32, 4)
    c = Candidate(rid="x", namespace="n", token_ids=list(range(10)), reserve=2)
    pool.step(RadixStep(pool="p", budget=100, max_admit=4, candidates=[c]))
    used = 32 - pool.free_pages
    pool.step(RadixStep(pool="p", budget=100, max_admit=4, candidates=[c]))   # the reply was lost: again
    assert 32 - pool.free_pages == used and len(pool.held) == 1


def test_running_requests_survive_a_radix_restart(engine):
    ids = {f"r{i}": prompt(100 + i, 40 + 150 * i) for i in range(4)}      # 40 .. 490 tokens: some prefill in chunks
    reqs = lambda ns: [msgspec.structs.replace(req(r, p, max_new_tokens=6 + 4 * i, ignore_eos=True), namespace=ns)
                       for i, (r, p) in enumerate(ids.items())]
    want, _, _ = run(engine, reqs("first"))

    for r in reqs("second"):      # nothing cached: the long prompts prefill in chunks, with progress
        engine.add(r)
    out: dict[str, list[int]] = {}
    forgot, start = 0, engine.steps
    while engine.has_work():
        if engine.steps == start + 1 and not forgot:
            # mid-flight: some requests decode, some prefill, one may not have started
            assert engine.num_running > 0
            engine.pages.pool = None          # the authority restarted: our pool is gone
            forgot = 1
        for _, o in engine.step():
            assert not o.error, o.error
            out.setdefault(o.rid, []).extend(o.token_ids)
    assert forgot and out == want
    assert no_leak(engine)


def test_held_parts_keep_order_and_stay_under_the_budget():
    from radixflow.services.executor.pages import held_parts
    from radixflow.shared import messages
    held = [HeldPages(rid=f"r{i}", namespace="n", tokens=list(range(50 * (i + 1))), pages=list(range(i + 1)), computed=1)
            for i in range(12)]
    sizes = [len(messages.encode(h)) for h in held]
    parts = held_parts(held, budget=400)
    assert [h.rid for p in parts for h in p] == [h.rid for h in held]
    for p in parts:      # a part passes the budget only when one request alone does
        assert sum(len(messages.encode(h)) for h in p) <= 400 or len(p) == 1
    assert len(parts) > 3 and any(s > 400 for s in sizes)
    assert held_parts([]) == [[]] and held_parts(held) == [held]


async def test_a_restarted_radix_service_takes_back_what_is_held_in_parts(models, monkeypatch):
    """Over NATS, against the real radix service: after it forgets the pool, the executor registers
    again with its running requests' pages in several messages (RadixRegister, then RadixAdopt),
    and the requests finish as without the restart, with no page leaked."""
    import asyncio
    from radixflow.services.executor import pages as pages_mod
    from radixflow.services.radix.service import RadixService
    from radixflow.shared.bus import Bus
    from radixflow.shared.config import BusConfig
    from radixflow.shared.natsd import NatsServer
    ids = {f"r{i}": prompt(200 + i, 40 + 150 * i) for i in range(4)}
    reqs = lambda ns: [msgspec.structs.replace(req(r, p, max_new_tokens=6 + 4 * i, ignore_eos=True), namespace=ns)
                       for i, (r, p) in enumerate(ids.items())]
    with NatsServer() as srv:
        bus, rbus = Bus("t", BusConfig(nats_url=srv.url)), Bus("radix", BusConfig(nats_url=srv.url))
        await bus.connect()
        await rbus.connect()
        radix = RadixService(rbus)
        await radix.start()
        try:
            remote = pages_mod.RemotePages(bus, asyncio.get_running_loop(), pool="p")
            cfg = EngineConfig(model=models["tiny-hybrid"], page_size=16, max_total_tokens=16384, max_running_requests=8,
                               max_prefill_tokens=256, overlap=False, pool="p", warmup_tokens=0)
            engine = await asyncio.to_thread(Engine, cfg, remote)
            want, _, _ = await asyncio.to_thread(run, engine, reqs("first"))
            monkeypatch.setattr(pages_mod, "HELD_BYTES", 1)       # every request in its own message
            adopted = []
            real_adopt = radix.adopt

            async def adopt(m):
                adopted.append(len(m.held))
                return await real_adopt(m)
            for r in radix._routes:
                if r.fn == real_adopt:
                    r.fn = adopt
            for r in reqs("second"):
                engine.add(r)
            out: dict[str, list[int]] = {}
            start = engine.steps
            while engine.has_work():
                if engine.steps == start + 1 and not adopted and "p" in radix.pools:
                    assert engine.num_running > 1
                    radix.pools.clear()           # a restarted radix knows no pool
                for _, o in await asyncio.to_thread(engine.step):
                    assert not o.error, o.error
                    out.setdefault(o.rid, []).extend(o.token_ids)
            assert out == want
            assert adopted and all(n == 1 for n in adopted)     # the second and later requests came in parts
            st = radix.pools["p"].stats()
            assert st["requests_held"] == 0 and st["kv_pages_private"] == 0
            assert st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"]
        finally:
            await radix.stop()
            await bus.close()
            await rbus.close()


async def test_an_idle_executor_whose_pool_was_dropped_registers_again(models):
    """The radix service drops a pool whose executor's beats are late (a loaded start: the compose
    layout's test met it, two executors starting on 2 cores). The executor, idle, hears from the
    radix service's own beats that its pool is not held and registers again; requests are served."""
    import asyncio
    from . import stacks
    st = await stacks.start(models["tiny-dense"])
    try:
        radix, ex = st.actors["radix"], st.actors["executor"]
        assert ex.instance in radix.pools
        radix.pools.pop(ex.instance)                  # what the reaper does to a pool gone silent
        radix.seen.pop(ex.instance, None)
        for _ in range(100):
            if ex.instance in radix.pools:
                break
            await asyncio.sleep(0.1)
        assert ex.instance in radix.pools, "the executor never registered its pool again"
        body = {"input_ids": prompt(5, 40), "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        async with st.http.post(st.base + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            assert len((await r.json())["output_ids"]) == 3
    finally:
        await stacks.stop(st)
