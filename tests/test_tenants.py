"""Tenants below the gateway: per-tenant limits (429 with a retry hint), cache scopes shared by
name, a per-owner KV page quota in radix, a flush of only some owners' namespaces, and the
per-tenant metrics. The plain classes first (no NATS), then the same through a real stack."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from radixflow.services.radix.pool import PagePool
from radixflow.services.radix.tree import owner_of
from radixflow.services.scheduler.table import RequestTable, Tracked, namespace_of
from radixflow.services.scheduler.tenants import TenantLedger
from radixflow.shared.errors import BadRequest, Overloaded, from_reply
from radixflow.shared.messages import (Candidate, ErrorReply, Progress, Release, SamplingParams, TenantLimits,
                                       decode, encode)

from .test_radix_tree import PoolMachine


# ---------------------------------------------------------------- the ledger


def test_ledger_limits_concurrency_and_release_gives_the_slot_back():
    ledger = TenantLedger(retry_after_s=2.5)
    lim = TenantLimits(max_concurrent=2)
    a, b = ledger.admit("acme", lim, 10), ledger.admit("acme", lim, 10)
    with pytest.raises(Overloaded) as e:
        ledger.admit("acme", lim, 10)
    assert e.value.code == 429 and e.value.retry_after == 2.5
    ledger.admit("other", lim, 10)                    # another tenant's limit is its own
    ledger.release(a)
    ledger.admit("acme", lim, 10)                     # the released slot is free again
    ledger.release(b)
    ledger.release(b)                                 # a second release of one hold changes nothing
    c = ledger.tenants["acme"]
    assert (c.requests_total, c.rejected_total, c.inflight, c.queued_tokens) == (3, 1, 1, 10)


def test_ledger_limits_queued_tokens():
    ledger = TenantLedger()
    lim = TenantLimits(max_queued_tokens=100)
    t = ledger.admit("acme", lim, 60)
    with pytest.raises(Overloaded) as e:
        ledger.admit("acme", lim, 41)                 # 60 + 41 > 100
    assert e.value.retry_after is not None
    ledger.admit("acme", lim, 40)                     # 60 + 40 fits exactly
    ledger.release(t)
    assert ledger.tenants["acme"].queued_tokens == 40
    with pytest.raises(BadRequest):                   # could never fit: a 429 would be retried forever
        ledger.admit("acme", lim, 101)
    ledger.admit("acme", None, 10**6)                 # no limits: counted, never refused


def test_ledger_samples_per_tenant():
    ledger = TenantLedger()
    ledger.admit("acme", TenantLimits(max_concurrent=1), 7)
    with pytest.raises(Overloaded):
        ledger.admit("acme", TenantLimits(max_concurrent=1), 7)
    got = {(s.name, s.labels["tenant"]): s.value for s in ledger.samples()}
    assert got == {("tenant_requests_total", "acme"): 1, ("tenant_rejected_total", "acme"): 1,
                   ("tenant_requests_inflight", "acme"): 1, ("tenant_queued_tokens", "acme"): 7}


def test_ticket_is_released_when_the_last_tracked_entry_leaves_the_table():
    """n > 1: a parent and n children hold one ticket; the submission holds it too until it returns,
    so a parent that ends before its children are tracked does not free the tenant's slot."""
    ledger, table = TenantLedger(), RequestTable()
    ticket = ledger.admit("acme", TenantLimits(max_concurrent=1), 5)

    def tracked(rid):
        return Tracked(rid=rid, stream_subject="", executor="ex", prompt_tokens=1, sampling=SamplingParams(),
                       deadline=0.0, ticket=ticket)
    table.add(tracked("r"))
    assert table.finish("r") is not None              # the prefill-only parent ends first
    for i in range(2):
        table.add(tracked(f"r/{i}"))
    ledger.release(ticket)                            # the submission returns
    assert ledger.tenants["acme"].inflight == 1
    table.finish("r/0")
    assert table.finish("r/0") is None                # already gone: releases nothing more
    assert ledger.tenants["acme"].inflight == 1
    table.finish("r/1")
    assert ledger.tenants["acme"].inflight == 0 and ledger.tenants["acme"].queued_tokens == 0


def test_retry_after_survives_the_error_reply_round_trip():
    ledger = TenantLedger(retry_after_s=3.0)
    ledger.admit("acme", TenantLimits(max_concurrent=1), 1)
    with pytest.raises(Overloaded) as e:
        ledger.admit("acme", TenantLimits(max_concurrent=1), 1)
    wire = decode(encode(e.value.to_reply()), ErrorReply)
    back = from_reply(wire)
    assert isinstance(back, Overloaded) and back.code == 429 and back.retry_after == 3.0
    assert "acme" in back.message
    assert from_reply(decode(encode(BadRequest("x").to_reply()), ErrorReply)).retry_after is None


def test_namespace_is_the_scope_plus_salt():
    assert namespace_of("team", None) == "team"
    assert namespace_of("team", "s1") == "team/s1"
    assert owner_of("team/s1") == owner_of("team") == "team"


# ---------------------------------------------------------------- radix page quota

PS = 2


def serve(pool: PagePool, rid: str, ns: str, toks: list[int], quota: int = 0) -> None:
    """Admit and finish one request: its whole pages are cached."""
    grants, deferred = pool.admit([Candidate(rid=rid, namespace=ns, token_ids=toks, reserve=0, quota_pages=quota)],
                                  budget=10**6, max_admit=8)
    assert grants, deferred
    pool.release(Release(rid=rid, computed=len(toks)))


HOT = [100 + i for i in range(8)] + [1]               # 4 cached pages


def flood(quota: int) -> PagePool:
    pool = PagePool(16, PS)
    serve(pool, "hot", "a", HOT)
    assert pool.match_len("a", HOT) == 8
    for i in range(10):                               # 10 distinct prompts of 4 cached pages each
        serve(pool, f"b{i}", "b/x" if i % 2 else "b", [200 + 10 * i + j for j in range(8)] + [1], quota)
        if quota:
            assert pool.cached_by_scope()["b"] <= quota
    return pool


def test_quota_keeps_a_flooding_tenant_off_another_tenants_hot_prefix():
    assert flood(quota=0).match_len("a", HOT) == 0    # plain LRU: the flood evicts the older hot prefix
    pool = flood(quota=4)
    assert pool.match_len("a", HOT) == 8              # with a quota the flood only replaces its own pages
    assert pool.cached_by_scope() == {"a": 4, "b": 4}
    assert pool.stats()["quota_evicted_pages_total"] > 0


def test_an_owner_at_its_quota_takes_its_own_pages_when_memory_is_short():
    """At (not over) its quota, with too few free pages: its own LRU pages go, not the hot prefix."""
    for quota, hot_survives in ((0, False), (4, True)):
        pool = PagePool(12, PS)
        serve(pool, "hot", "a", HOT)
        serve(pool, "b0", "b", [200 + j for j in range(9)], quota)
        assert pool.free_pages == 4 and pool.cached_by_scope()["b"] == 4
        serve(pool, "b1", "b", [300 + j for j in range(9)], quota)     # needs 5 pages
        assert (pool.match_len("a", HOT) == 8) == hot_survives


def test_an_owner_with_a_quota_is_never_stuck_behind_others_cache():
    """At its quota, its one cached page locked by the prefix it matches, memory full of another's
    cache: it still runs (global LRU); deferring it would wait forever on its own lock."""
    pool = PagePool(8, PS)
    serve(pool, "hot", "a", [100 + i for i in range(10)] + [1])   # 5 cached pages
    serve(pool, "b0", "b", [1, 2, 3], quota=1)                     # 1 cached page: at its quota
    assert pool.free_pages == 2
    grants, deferred = pool.admit([Candidate(rid="b1", namespace="b", token_ids=[1, 2, 9, 9, 9, 9, 5], reserve=0,
                                             quota_pages=1)], 10**6, 8)
    assert grants and grants[0].cached_tokens == 2, deferred


def test_hybrid_a_flood_with_a_quota_drops_its_own_checkpoints_not_anothers():
    """State slots are the hybrid model's other scarce resource: a dropped checkpoint keeps the KV
    but makes the prefix unresumable. The page quota here is large: only states are short."""
    for quota, hot_resumes in ((0, False), (100, True)):
        pool = PagePool(64, PS, num_state_slots=6)
        serve(pool, "hot", "a", HOT)                  # keeps 1 checkpoint (at 8)
        for i in range(4):                            # each needs 3 slots and keeps 1
            serve(pool, f"b{i}", "b", [200 + 10 * i + j for j in range(9)], quota)
        assert pool.match_len("a", HOT) == (8 if hot_resumes else 0)


def test_scoped_flush_frees_only_the_named_owners_namespaces():
    pool = PagePool(64, PS)
    for ns in ("a", "b", "b/x", "bb"):
        serve(pool, f"r-{ns}", ns, [7, 7, 8, 8, 9])   # 2 cached pages each
    pool.admit([Candidate(rid="live", namespace="b", token_ids=[1, 2, 3, 4, 5], reserve=0)], 10**6, 8)
    pool.progress(Progress(rid="live", computed=4))   # 2 more pages in "b", locked by a running request
    assert pool.flush(["b"]) == 4                     # "b" and "b/x"; the locked ones stay
    assert pool.match_len("b", [7, 7, 8, 8, 9]) == 0 and pool.match_len("b/x", [7, 7, 8, 8, 9]) == 0
    assert pool.match_len("b", [1, 2, 3, 4, 5]) == 4
    assert pool.match_len("a", [7, 7, 8, 8, 9]) == 4 and pool.match_len("bb", [7, 7, 8, 8, 9]) == 4
    assert pool.cached_by_scope() == {"a": 2, "b": 2, "bb": 2}
    assert pool.stats()["evicted_pages_total"] == 0   # a flush is not memory pressure
    assert pool.flush([]) == 4                        # empty: every owner's unlocked pages


class QuotaMachine(PoolMachine):
    """The pool's property test with page quotas: content still equals the oracle, pages are still
    conserved, the per-owner counts are exact, and after a release its owner is within its quota
    unless every page it still has is locked."""
    PAGE = 2
    PAGES = 16

    @rule(ns=st.sampled_from(["a", "b", "b/x"]), toks=st.lists(st.integers(0, 2), min_size=1, max_size=14),
          reserve=st.integers(0, 4), quota=st.sampled_from([0, 1, 2, 4]))
    def acquire_quota(self, ns, toks, reserve, quota):
        rid = f"q{self.n}"
        self.n += 1
        want = self.oracle_match(ns, toks[:-1])
        grants, _ = self.track(lambda: self.pool.admit(
            [Candidate(rid=rid, namespace=ns, token_ids=toks, reserve=reserve, quota_pages=quota)], 10**6, 8))
        if grants:
            assert grants[0].cached_tokens == want    # its own eviction never takes the prefix it matched

    @precondition(lambda self: self.pool.held)
    @rule(data=st.data(), out=st.lists(st.integers(0, 2), max_size=5))
    def release(self, data, out):
        before = dict(self.pool.held)
        PoolMachine.release(self, data, out)
        (h,) = [h for rid, h in before.items() if rid not in self.pool.held]
        owner = owner_of(h.namespace)
        # the parent rule adds what the release inserted; a quota trim in the same release took some
        # of it back, or older entries, but only ever the releasing owner's
        content = self.tree_content()
        gone = [key for key in self.oracle if key not in content]
        assert all(owner_of(ns) == owner for ns, _ in gone) and (h.quota or not gone)
        self.oracle = {k: v for k, v in self.oracle.items() if k in content}
        if h.quota:
            mine = [n for n in self.pool.tree.nodes() if owner_of(n.namespace) == owner]
            assert self.pool.tree.owner_pages.get(owner, 0) <= h.quota or all(n.lock for n in mine)

    @invariant()
    def owner_counts_are_exact(self):
        counts: dict[str, int] = {}
        for n in self.pool.tree.nodes():
            counts[owner_of(n.namespace)] = counts.get(owner_of(n.namespace), 0) + len(n.pages)
        assert self.pool.tree.owner_pages == counts


TestQuotaPool = QuotaMachine.TestCase
TestQuotaPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_batcher_passes_the_quota_to_radix():
    from radixflow.services.executor.batcher import Batcher
    from radixflow.services.executor.sequence import Sequence
    b = Batcher(pool="p", max_running=4, max_prefill_tokens=64)
    seq = Sequence(rid="r", tokens=[1, 2, 3], sampling=SamplingParams(), eos_ids=frozenset(), namespace="a")
    seq.quota_pages = 7
    b.add(seq)
    assert b.radix_message().candidates[0].quota_pages == 7


# ---------------------------------------------------------------- through a real stack (no gateway)


@pytest.fixture(scope="module")
async def engine(nats_server, models):
    from radixflow.services.stack import Stack, stack_config
    st = await Stack(stack_config(nats_server.url, models["tiny-dense"], gw_port=0),
                     names=("tokenizer", "grammar", "radix", "executor", "scheduler")).start()
    sched = st.actors["scheduler"]
    for _ in range(200):
        if any(e.info.max_model_len > 0 for e in sched.executors.values()):
            break
        await asyncio.sleep(0.05)
    yield st
    await st.stop()


async def test_limits_scopes_and_scoped_flush_through_the_stack(engine, nats_server):
    from radixflow.shared import subjects
    from radixflow.shared.bus import Bus
    from radixflow.shared.config import BusConfig
    from radixflow.shared.messages import (AbortRequest, Accepted, GenerateRequest, RadixFlush, RadixFlushed,
                                           StreamChunk)
    sched, radix = engine.actors["scheduler"], engine.actors["radix"]
    (ex,) = sched.executors.values()
    bus = Bus("tenant-test", BusConfig(nats_url=nats_server.url))
    await bus.connect()
    prompt = [5 + i for i in range(40)]
    one = TenantLimits(max_concurrent=1)

    async def run(rid: str, tenant: str, scope: str = "", max_new: int = 2, limits=None) -> StreamChunk:
        async with bus.open_stream(idle_timeout_s=60) as s:
            await bus.request(subjects.SCHEDULER_SUBMIT, GenerateRequest(
                rid=rid, stream_subject=s.subject, input_ids=prompt, tenant=tenant, cache_scope=scope, limits=limits,
                sampling=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)), Accepted)
            items = [i async for i in s]
        assert isinstance(items[-1], StreamChunk) and items[-1].finished, items[-1]
        return items[-1]

    # a tenant at max_concurrent gets 429 with a retry hint over the bus; others do not
    async with bus.open_stream(idle_timeout_s=60) as s:
        await bus.request(subjects.SCHEDULER_SUBMIT, GenerateRequest(
            rid="long", stream_subject=s.subject, input_ids=prompt, tenant="acme", limits=one,
            sampling=SamplingParams(max_new_tokens=ex.info.max_model_len - len(prompt), ignore_eos=True)), Accepted)
        with pytest.raises(Overloaded) as e:
            await run("second", "acme", limits=one)
        assert e.value.code == 429 and e.value.retry_after and e.value.retry_after > 0
        await run("other", "globex", limits=one)
        # ids are scoped by tenant: globex's abort of "long" leaves acme's running (its slot still held)
        await bus.publish(subjects.SCHEDULER_ABORT, AbortRequest(rids=["long"], tenant="globex"))
        await run("other2", "globex", limits=one)
        with pytest.raises(Overloaded):
            await run("second2", "acme", limits=one)
        await bus.publish(subjects.SCHEDULER_ABORT, AbortRequest(rids=["long"], tenant="acme"))
        assert [i async for i in s][-1].finish_reason == "abort"
    await run("again", "acme", limits=one)            # its slot came back when "long" ended
    got = {(x.name, x.labels.get("tenant")): x.value for x in sched.metrics()}
    assert got[("tenant_rejected_total", "acme")] == 2 and got[("tenant_requests_total", "acme")] == 2
    assert got[("tenant_requests_inflight", "acme")] == 0 and got[("tenant_queued_tokens", "acme")] == 0

    # two tenants naming one cache scope share its cache; a third keeps its own
    await run("u1", "u1", scope="team")
    assert (await run("u2", "u2", scope="team")).usage.cached_tokens >= 32
    assert (await run("u3", "u3")).usage.cached_tokens == 0
    await run("u3b", "u3")
    pool = radix.pools[ex.instance]
    assert pool.match_len("team", prompt) >= 32 and pool.match_len("u3", prompt) >= 32

    # a scoped flush empties that scope only
    out = await bus.request(subjects.RADIX_FLUSH, RadixFlush(scopes=["team"]), RadixFlushed)
    assert out.freed_pages >= 2
    assert pool.match_len("team", prompt) == 0 and pool.match_len("u3", prompt) >= 32
    scopes = {x.labels["scope"] for x in radix.metrics() if x.name == "scope_kv_pages_cached"}
    assert "u3" in scopes and "team" not in scopes
    await bus.close()
