"""Programs as plain classes: the graph's validation (every 400 names the node), ordering, failure
and cancel propagation, join substitution, the select rule; and the radix pool's pins and demotion."""
from __future__ import annotations

import msgspec
import pytest

from radixflow.services.radix.pool import PagePool
from radixflow.services.scheduler.graph import Limits, ProgramGraph
from radixflow.services.scheduler.policy import SPECULATIVE_PRIORITY, ProgramPolicy
from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import Candidate, Demote, ProgramNode, RadixStep, Release


def nodes(*specs: dict) -> list[ProgramNode]:
    return [msgspec.convert(s, ProgramNode) for s in specs]


def graph(*specs: dict, **limits) -> ProgramGraph:
    return ProgramGraph(nodes(*specs), Limits(**limits))


def bad(*specs: dict, **limits) -> str:
    """Validate as the scheduler does: the graph, then (texts tokenized: a token per word) the token bounds."""
    with pytest.raises(BadRequest) as e:
        g = graph(*specs, **limits)
        for n in g.order:
            if n.spec.input_ids is not None:
                n.own_ids = list(n.spec.input_ids)
            elif not n.needs_late_text:
                n.own_ids = [5] * len(n.spec.text.split())
        g.check_tokens(max_model_len=4096, vocab_size=100)
    assert e.value.code == 400
    return e.value.message


@pytest.mark.parametrize("specs, named", [
    ([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "'a': duplicate id"),
    ([{"id": "a", "text": "x", "parent": "nope"}], "'a': parent 'nope' is not a node"),
    ([{"id": "a", "text": "x", "after": ["ghost"]}], "'a': after names 'ghost'"),
    ([{"id": "a", "text": "x", "parent": "b"}, {"id": "b", "text": "y", "parent": "a"}], "dependency cycle"),
    ([{"id": "a", "text": "x"}, {"id": "b", "text": "y", "after": ["c"]}, {"id": "c", "text": "z", "after": ["b"]}],
     "dependency cycle"),
    ([{"id": "a", "text": "x", "parent": "a"}], "'a': a node cannot depend on itself"),
    ([{"id": "a", "text": "x"}, {"id": "b", "text": "use {a}"}], "'b': its text names {a}, but 'a' is not in its after"),
    ([{"id": "a", "text": "x"}, {"id": "b", "text": "q", "after": [], "select": {"choices": ["{a}", "no"]}}],
     "'b': its text names {a}"),
    ([{"id": "a", "text": "x", "gen": {}, "select": {"choices": ["y"]}}], "'a': give gen or select"),
    ([{"id": "a", "text": ""}], "'a': a node without a parent needs text"),
    ([{"id": "a b", "text": "x"}], "'a b': ids are"),
    ([{"id": "a", "text": "x", "gen": {"max_tokens": 0}}], "'a': gen.max_tokens must be at least 1"),
    ([{"id": "a", "text": "x", "gen": {"temperature": -1}}], "'a': gen: temperature"),
    ([{"id": "a", "text": "x", "gen": {"regex": "a", "json_schema": {"type": "string"}}}], "'a': gen: give at most one structured-output constraint"),
    ([{"id": "a", "text": "x", "select": {"choices": []}}], "'a': select needs 1 to"),
    ([{"id": "a", "text": "x", "input_ids": [1]}], "'a': give text or input_ids"),
    ([{"id": "a", "input_ids": [1, 200]}], "'a': token ids must be < the vocabulary size 100"),
    ([{"id": "a", "input_ids": [1] * 4000}, {"id": "b", "parent": "a", "gen": {"max_tokens": 200}}],
     "'b': its prompt may reach 4000 tokens, plus 200"),
])
def test_invalid_programs_are_400_naming_the_node(specs, named):
    assert named in bad(*specs)


def test_program_limits():
    many = [{"id": f"n{i}", "text": "x"} for i in range(5)]
    assert "at most 4 nodes" in bad(*many, max_nodes=4)
    assert "the limit is 10" in bad({"id": "a", "text": "x", "gen": {"max_tokens": 20}}, max_tokens=10)
    assert "at least one node" in bad()


def test_references_to_unknown_names_stay_literal():
    g = graph({"id": "a", "text": "x", "gen": {}}, {"id": "j", "after": ["a"], "text": 'JSON {"k": 1} {a} {zzz}'})
    g.nodes["a"].output, g.nodes["a"].state = "OUT", "done"
    assert g.resolve(g.nodes["j"]) == 'JSON {"k": 1} OUT {zzz}'


def test_ready_in_dependency_order_and_children_together():
    g = graph({"id": "p", "text": "pre"}, *({"id": f"c{i}", "parent": "p", "text": f"t{i}", "gen": {}} for i in range(3)),
              {"id": "j", "after": ["c0", "c1", "c2"], "text": "{c0}{c1}{c2}", "gen": {}})
    assert [n.id for n in g.ready()] == ["p"]
    g.nodes["p"].state = "running"
    assert g.ready() == []
    g.nodes["p"].state = "done"
    assert [n.id for n in g.ready()] == ["c0", "c1", "c2"]     # all siblings at once
    for i in range(3):
        g.nodes[f"c{i}"].state = "done"
    assert [n.id for n in g.ready()] == ["j"]


def test_failure_and_cancel_propagate_to_dependents_only():
    g = graph({"id": "p", "text": "pre"}, {"id": "a", "parent": "p", "gen": {}}, {"id": "b", "parent": "p", "gen": {}},
              {"id": "c", "parent": "a", "gen": {}}, {"id": "j", "after": ["a", "b"], "text": "{a}{b}", "gen": {}})
    changed = g.end(g.nodes["a"], "failed", 503, "executor died")
    assert [n.id for n in changed] == ["a", "c", "j"]
    assert g.nodes["c"].error == "dependency 'a' failed: executor died" and g.nodes["c"].error_code == 503
    assert g.nodes["b"].state == "pending" and g.nodes["p"].state == "pending"
    changed = g.cancel("b")
    assert [n.id for n in changed] == ["b"]                  # j already failed: ended once
    assert g.cancel("b") == []
    g.nodes["p"].state = "done"
    assert g.finished
    g = graph({"id": "p", "text": "pre"}, {"id": "a", "parent": "p", "gen": {}}, {"id": "b", "parent": "a", "gen": {}})
    g.nodes["p"].state = "done"
    assert [n.id for n in g.cancel()] == ["a", "b"]           # the whole program: what is not done yet
    assert g.nodes["b"].error == "dependency 'a' was cancelled" and g.finished


def test_policy_jobs_pins_and_priorities():
    g = graph({"id": "p", "input_ids": [1, 2, 3]}, {"id": "a", "parent": "p", "input_ids": [4], "gen": {"max_tokens": 5}},
              {"id": "s", "parent": "p", "input_ids": [9], "select": {"choices": ["x", "yy"]}, "speculative": True},
              {"id": "leaf", "input_ids": [7]})
    for n in g.order:
        n.own_ids = list(n.spec.input_ids)
    pol = ProgramPolicy()
    [jp] = pol.jobs(g, g.nodes["p"])
    assert jp.sampling.max_new_tokens == 0 and jp.pin and jp.checkpoint_at == [3]      # a fork point
    [jl] = pol.jobs(g, g.nodes["leaf"])
    assert not jl.pin and jl.checkpoint_at == []
    g.nodes["p"].state, g.nodes["p"].output_ids = "done", []
    [ja] = pol.jobs(g, g.nodes["a"])
    assert ja.input_ids == [1, 2, 3, 4] and ja.sampling.max_new_tokens == 5 and not ja.pin
    js = pol.jobs(g, g.nodes["s"], [[11], [12, 13]])
    assert [j.input_ids for j in js] == [[1, 2, 3, 9, 11], [1, 2, 3, 9, 12, 13]]
    assert {j.logprob_start for j in js} == {4} and {j.priority for j in js} == {SPECULATIVE_PRIORITY}
    assert all(j.sampling.max_new_tokens == 0 for j in js)


def test_select_picks_the_highest_mean_logprob():
    assert ProgramPolicy.choose([[-1.0, -3.0], [-1.5], [-0.1, -9.0]]) == (1, [-2.0, -1.5, -4.55])
    assert ProgramPolicy.choose([[-1.0], [-1.0]])[0] == 0      # ties: the first


def test_discarded_branches_are_losing_speculative_choices():
    g = graph({"id": "p", "text": "x"}, *({"id": f"d{i}", "parent": "p", "gen": {}, "speculative": True} for i in range(3)),
              {"id": "s", "parent": "p", "after": ["d0", "d1", "d2"], "select": {"choices": ["{d0}", "{d1}", "{d2}"]}})
    assert [n.id for n in ProgramPolicy.discarded_branches(g, g.nodes["s"], 1)] == ["d0", "d2"]


# ---------------------------------------------------------------- the radix pool: pins and demotion

PS = 4


def admit(pool: PagePool, rid: str, tokens: list[int], reserve: int = 0, **kw):
    reply = pool.step(RadixStep(pool="p", budget=10_000, max_admit=8,
                                candidates=[Candidate(rid=rid, namespace="ns", token_ids=tokens, reserve=reserve, **kw)]))
    return reply.grants[0] if reply.grants else None


def finish(pool: PagePool, rid: str, computed: int, **kw):
    pool.step(RadixStep(pool="p", budget=0, max_admit=0, releases=[Release(rid=rid, computed=computed, **kw)]))


def test_a_pinned_prefix_survives_eviction_pressure_until_unpinned():
    pool = PagePool(num_pages=8, page_size=PS)
    parent = list(range(100, 116))                    # 4 pages
    admit(pool, "p", parent)
    finish(pool, "p", 16, pin="prog/p")
    assert pool.stats()["kv_pages_pinned"] == 4 and pool.tree.evictable_pages == 0
    # other traffic wants 8 pages: only the 4 unpinned ones can be had
    assert admit(pool, "x", list(range(500, 532))) is None
    g = admit(pool, "y", list(range(600, 616)))
    assert g is not None
    finish(pool, "y", 16)
    child = admit(pool, "c", parent + [7, 8, 9])
    assert child.cached_tokens == 16                   # the whole parent, still cached
    pool.unpin(["prog/p"])
    assert pool.stats()["kv_pages_pinned"] == 0
    finish(pool, "c", 19)
    assert pool.tree.evictable_pages == pool.tree.cached_pages    # nothing locked any more


def test_unpin_before_release_does_not_leak_a_pin():
    pool = PagePool(num_pages=8, page_size=PS)
    admit(pool, "p", list(range(8)))
    pool.unpin(["k"])                                  # the program ended while the release was in flight
    finish(pool, "p", 8, pin="k")
    assert pool.pins == {} and pool.tree.evictable_pages == 2


def test_expired_pins_are_released():
    pool = PagePool(num_pages=8, page_size=PS)
    admit(pool, "p", list(range(8)))
    finish(pool, "p", 8, pin="k", pin_ttl_s=5)
    assert pool.expire_pins(now=0) == []
    assert pool.expire_pins(now=1e12) == ["k"] and pool.tree.evictable_pages == 2


def test_discarded_and_demoted_pages_are_evicted_first():
    pool = PagePool(num_pages=12, page_size=PS)
    shared = list(range(8))
    admit(pool, "a", shared + [50, 51, 52, 53])
    finish(pool, "a", 12)
    admit(pool, "b", shared + [60, 61, 62, 63])
    finish(pool, "b", 12, discard=True)                # cancelled: inserted nothing more, freed its own pages
    assert len(pool.tree.sequences("ns")) == 1
    admit(pool, "c", shared + [70, 71, 72, 73])        # more recent than a ...
    finish(pool, "c", 12)
    pool.step(RadixStep(pool="p", budget=0, max_admit=0, demotes=[Demote(namespace="ns",
                                                                         token_ids=shared + [70, 71, 72, 73], keep=8)]))
    ev = pool.tree.evict(1)                            # ... but demoted: it goes first, the shared prefix stays
    [(toks, _)] = [s for s in pool.tree.sequences("ns")]
    assert len(ev.pages) == 1 and toks == tuple(shared + [50, 51, 52, 53])


def test_admission_prefers_higher_priority():
    pool = PagePool(num_pages=4, page_size=PS)
    reply = pool.step(RadixStep(pool="p", budget=10_000, max_admit=1, candidates=[
        Candidate(rid="spec", namespace="ns", token_ids=[1, 2, 3], reserve=0, priority=SPECULATIVE_PRIORITY),
        Candidate(rid="main", namespace="ns", token_ids=[4, 5, 6], reserve=0)]))
    assert [g.rid for g in reply.grants] == ["main"]


def test_prompt_logprob_requests_recompute_from_max_cached():
    pool = PagePool(num_pages=16, page_size=PS)
    prefix = list(range(16))
    admit(pool, "p", prefix)
    finish(pool, "p", 16)
    assert admit(pool, "free", prefix + [99]).cached_tokens == 16
    assert admit(pool, "lp", prefix + [98], max_cached=15).cached_tokens == 12


# ---------------------------------------------------------------- the executor's batcher: children sent early

def test_a_child_waits_at_the_executor_until_its_parents_release():
    from radixflow.services.executor.batcher import Batcher
    from radixflow.services.executor.sequence import Sequence
    from radixflow.shared.messages import Grant, SamplingParams
    b = Batcher(pool="p", max_running=8, max_prefill_tokens=1000)
    seq = lambda rid, **kw: Sequence(rid=rid, tokens=list(range(40)), sampling=SamplingParams(max_new_tokens=0),
                                     eos_ids=frozenset(), **kw)
    parent, child, other = seq("prog/p"), seq("prog/c", after="prog/p"), seq("x")
    for s in (parent, child, other):
        b.add(s)
    assert [c.rid for c in b.radix_message().candidates] == ["prog/p", "x"]     # the child is held
    b.apply([Grant(rid="prog/p", cached_tokens=0, pages=[1, 2, 3])], retry=True)
    assert [c.rid for c in b.radix_message().candidates] == ["x"]
    parent.finish("length")
    b.finish(parent)
    msg = b.radix_message()
    assert [r.rid for r in msg.releases] == ["prog/p"]                        # released, then ...
    assert [c.rid for c in msg.candidates] == ["prog/c", "x"]                 # ... the child asks, same message


def test_candidates_left_out_by_the_size_cap_are_asked_again():
    from radixflow.services.executor.batcher import Batcher
    from radixflow.services.executor.sequence import Sequence
    from radixflow.shared.messages import SamplingParams
    b = Batcher(pool="p", max_running=8, max_prefill_tokens=10_000, max_candidate_tokens=100)
    for i in range(3):
        b.add(Sequence(rid=f"r{i}", tokens=list(range(60)), sampling=SamplingParams(), eos_ids=frozenset()))
    assert [c.rid for c in b.radix_message().candidates] == ["r0"]
    b.apply([], retry=False)                       # nothing granted, nothing deferred for budget ...
    assert [c.rid for c in b.radix_message().candidates] == ["r0"]   # ... still, the others wait to be asked
    assert b.has_work()
