"""Admission by a PagePool, by example: namespaces, the order of grants, a prefix computed once,
where siblings part, the checkpoint ladder for a late sibling, and prompts sent once. The pool's
invariants under random operations are test_radix_tree.py's property tests."""
from __future__ import annotations

from radixflow.services.radix.pool import PagePool
from radixflow.shared.messages import Candidate, Progress, Release


def test_namespaces_never_share():
    pool = PagePool(16, 2)
    toks = [1, 2, 3, 4, 5, 6, 7]
    g, _ = pool.admit([Candidate(rid="a", namespace="t1", token_ids=toks, reserve=1)], 10**6, 4)
    pool.release(Release(rid="a", computed=7))
    assert pool.match_len("t1", toks) == 6
    assert pool.match_len("t2", toks) == 0
    g, _ = pool.admit([Candidate(rid="b", namespace="t2", token_ids=toks, reserve=1)], 10**6, 4)
    assert g[0].cached_tokens == 0


def test_longest_prefix_first_and_shared_uncached_prefix_computed_once():
    pool = PagePool(64, 2)
    base = [9, 9, 8, 8, 7, 7]
    g, _ = pool.admit([Candidate(rid="warm", namespace="n", token_ids=base + [1], reserve=0)], 10**6, 8)
    pool.release(Release(rid="warm", computed=7))
    cold = Candidate(rid="cold", namespace="n", token_ids=[5, 5, 5, 5, 1], reserve=0)
    hot = Candidate(rid="hot", namespace="n", token_ids=base + [2, 2, 3], reserve=0)
    twin = Candidate(rid="twin", namespace="n", token_ids=[5, 5, 5, 5, 2], reserve=0)
    grants, deferred = pool.admit([cold, hot, twin], budget=10**6, max_admit=8)
    assert [g.rid for g in grants] == ["hot", "cold"]           # longest cached prefix first
    assert [(d.rid, d.reason) for d in deferred] == [("twin", "shared-prefix")]
    grants, deferred = pool.admit([twin], budget=10**6, max_admit=8)
    assert not grants and deferred[0].reason == "shared-prefix"   # still being computed: still waits
    pool.progress(Progress(rid="cold", computed=5))
    grants, _ = pool.admit([twin], budget=10**6, max_admit=8)
    assert grants[0].cached_tokens == 4                          # the twin now reuses what cold computed



def test_parting_point_of_a_grant():
    from radixflow.services.radix.pool import PagePool
    from radixflow.shared.messages import Candidate
    pool = PagePool(num_pages=64, page_size=4, num_state_slots=8)
    pre = list(range(100, 150))
    c = lambda rid, ids, ns="t": Candidate(rid=rid, namespace=ns, token_ids=ids, reserve=4)
    a, b, cc, d = c("a", pre + [1, 2]), c("b", pre + [3]), c("c", pre[:20] + [9] * 8), c("d", pre + [1, 2], "u")
    e, f = c("e", [7, 8, 9, 10, 11]), c("f", [7, 8, 9, 10, 11])
    cands = [a, b, cc, d, e, f]
    assert pool._parting_point(a, 0, cands) == 50       # with b (c parts at 20; d is another namespace)
    assert pool._parting_point(cc, 0, cands) == 20
    assert pool._parting_point(a, 44, cands) == 50      # beyond what is cached ...
    assert pool._parting_point(a, 48, cands) == 0       # ... but not by a page: no boundary to checkpoint
    assert pool._parting_point(b, 44, [b, cc]) == 0     # c shares nothing past 44
    assert pool._parting_point(e, 0, cands) == 4        # identical prompts: all but the last token
    assert pool._parting_point(d, 0, cands) == 0        # alone in its namespace


def test_a_late_sibling_resumes_near_its_parting_point():
    """Hybrid: a sibling that arrives after the first of its fan-out was granted alone (no parting
    point planned) resumes from the ladder of checkpoints back from the end of the first's prompt
    (every page of its last 128 tokens: here exactly where they part), not from the start; with
    state slots short the ladder is not planned."""
    from radixflow.services.radix.pool import PagePool
    from radixflow.shared.messages import RadixStep, Release
    pre = list(range(100, 3100))                              # 3,000-token preamble
    first = Candidate(rid="a", namespace="n", token_ids=pre + [1] * 100, reserve=8)
    late = Candidate(rid="b", namespace="n", token_ids=pre + [2] * 100, reserve=8)
    step = lambda pool, cs, **kw: pool.step(RadixStep(pool="p", budget=10**6, max_admit=8, candidates=cs, **kw))
    got = {}
    for slots in (64, 8):
        pool = PagePool(num_pages=2048, page_size=16, num_state_slots=slots, checkpoint_interval=8192)
        if slots == 64:
            # a warm pool: other long prompts left their checkpoints in the tree (unlocked, so
            # they count as spare), and few slots are on the free list
            for i in range(20):
                other = Candidate(rid=f"o{i}", namespace="n", token_ids=[5000 + i] * 1000, reserve=8)
                step(pool, [other])
                step(pool, [], releases=[Release(rid=f"o{i}", output_ids=[], computed=1000)])
            assert len(pool._free_states) < 64 // 4 < pool.tree.droppable_states()
        g = step(pool, [first]).grants[0]
        step(pool, [], progress=[Progress(rid="a", computed=3100)])
        step(pool, [], releases=[Release(rid="a", output_ids=[], computed=3100)])
        got[slots] = (g.checkpoints, step(pool, [late]).grants[0].cached_tokens)
    end = 3100 // 16 * 16
    assert got[64][0] == sorted({end - d for d in (2048, 1024, 512, 256, *range(16, 129, 16))} | {end})
    assert got[64][1] == 3000 // 16 * 16                      # where they part: 8 + 100 tokens to compute
    assert got[8] == ([end], 0)                               # short of slots: the whole prompt again


def test_a_deferred_candidate_comes_back_without_its_prompt():
    """Candidate.known: the pool keeps the prompts of the candidates it deferred in a step, for the
    next step only; one sent `known` that it does not have is deferred as "unknown"."""
    from radixflow.shared.messages import RadixStep
    pre = list(range(100, 164))
    cands = [Candidate(rid=f"r{i}", namespace="n", token_ids=pre + [i, i + 1], reserve=2) for i in range(4)]
    ref = lambda c: Candidate(rid=c.rid, namespace="n", token_ids=[], reserve=2, known=True)
    step = lambda pool, cs, **kw: pool.step(RadixStep(pool="p", budget=10**6, max_admit=8, candidates=cs, **kw))
    pools = PagePool(64, 4), PagePool(64, 4)
    for pool, second in zip(pools, ([ref(c) for c in cands[1:]], cands[1:])):
        first = step(pool, cands)
        assert [g.rid for g in first.grants] == ["r0"]
        assert [(d.rid, d.reason) for d in first.deferred] == [(c.rid, "shared-prefix") for c in cands[1:]]
        r = step(pool, second, progress=[Progress(rid="r0", computed=66)])
        assert [(g.rid, g.cached_tokens) for g in r.grants] == [("r1", 64), ("r2", 64), ("r3", 64)]
    assert pools[0].held["r2"].tokens == pools[1].held["r2"].tokens == cands[2].token_ids
    pool = PagePool(64, 4)
    step(pool, cands)                                          # r1..r3 kept
    r = step(pool, [ref(cands[1])])                            # r2, r3 not asked for: forgotten
    assert [(d.rid, d.reason) for d in r.deferred] == [("r1", "shared-prefix")]
    r = step(pool, [ref(cands[1]), ref(cands[2]), ref(Candidate(rid="x", namespace="n", token_ids=[1], reserve=0))])
    assert [(d.rid, d.reason) for d in r.deferred] == [("r1", "shared-prefix"), ("r2", "unknown"), ("x", "unknown")]
    assert pool._kept.keys() == {"r1"}
