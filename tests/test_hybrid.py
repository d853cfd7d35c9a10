"""Hybrid models (Gated DeltaNet + attention): a prefix is reused only from a state checkpoint taken
at exactly its boundary; never KV against a stale state."""
from __future__ import annotations

import random

import pytest
import torch

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.executor.forward_batch import ForwardBatch
from radixflow.services.executor.memory import KVPool, MemoryPlan, StatePool
from radixflow.services.executor.models import ModelSpec, load_model
from radixflow.shared.messages import ExecRequest, SamplingParams

PAGE = 16


class Runner:
    """The hybrid model over explicit pages and state slots (what the engine does, spelled out)."""

    def __init__(self, path):
        self.spec = ModelSpec.from_dir(path)
        self.model = load_model(path, torch.device("cpu"), torch.float32)
        plan = MemoryPlan(page_size=PAGE, num_pages=400, num_state_slots=8, kv_dtype=torch.float32,
                          state_dtype=torch.float32)
        self.kv, self.state = KVPool(self.spec, plan, torch.device("cpu")), StatePool(self.spec, plan, torch.device("cpu"))

    def prefill(self, tokens, start, end, pages, slot):
        slots = self.kv.token_slots(pages, end)
        fb = ForwardBatch(is_decode=False, input_ids=torch.tensor(tokens[start:end]), positions=torch.arange(start, end),
                          out_slots=slots[start:end], prefix_lens=[start], extend_lens=[end - start], seq_slots=[slots],
                          state_slots=torch.tensor([slot]), logits_rows=torch.arange(end - start))
        return self.model(fb, self.kv, self.state)


@pytest.mark.parametrize("prefix_len", [1000, 1024])   # the first prompt ends mid-page / on a page boundary
def test_resume_from_checkpoint_equals_recompute(models, prefix_len):
    r = Runner(models["tiny-hybrid"])
    rng = random.Random(prefix_len)
    first = [rng.randrange(3, 8000) for _ in range(prefix_len)]
    second = first + [rng.randrange(3, 8000) for _ in range(77)]
    boundary = prefix_len // PAGE * PAGE                 # where the tree can hold a checkpoint
    shared_pages = list(range(boundary // PAGE))
    # request 1: prefill, copying the state out at the page boundary (slot 5 is the checkpoint)
    r.state.reset(0)
    r.prefill(first, 0, boundary, shared_pages + [300, 301], 0)
    r.state.copy(0, 5)
    if boundary < prefix_len:
        r.prefill(first, boundary, prefix_len, shared_pages + [300, 301], 0)
    # request 2: restore the checkpoint, reuse the shared pages, compute only the rest
    r.state.copy(5, 1)
    resumed = r.prefill(second, boundary, len(second), shared_pages + [310, 311, 312, 313, 314, 315], 1)
    # from scratch, in other pages and another slot
    r.state.reset(2)
    scratch = r.prefill(second, 0, len(second), list(range(200, 200 + len(second) // PAGE + 1)), 2)
    torch.testing.assert_close(resumed, scratch[boundary:], atol=1e-4, rtol=1e-4)
    # and the states the two leave behind are the same
    r.state.copy(1, 6)
    torch.testing.assert_close(r.state.recurrent[0][6], r.state.recurrent[0][2], atol=1e-4, rtol=1e-4)
    # a stale state (taken at another boundary) really would be wrong: the check can fail
    r.state.reset(3)
    r.prefill(first, 0, boundary - PAGE, shared_pages, 3)
    stale = r.prefill(second, boundary, len(second), shared_pages + [320, 321, 322, 323, 324, 325], 3)
    assert (stale - scratch[boundary:]).abs().max() > 1e-2


def req(rid, ids, n=8):
    return ExecRequest(rid=rid, input_ids=ids, eos_token_ids=[],
                       sampling=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))


def run(engine, reqs):
    for r in reqs:
        engine.add(r)
    out, meta = {}, {}
    while engine.has_work():
        for _, o in engine.step():
            out.setdefault(o.rid, []).extend(o.token_ids)
            meta[o.rid] = o.cached_tokens
    return out, meta


@pytest.fixture(scope="module")
def engines(models):
    kw = dict(model=models["tiny-hybrid"], page_size=PAGE, max_total_tokens=65536, max_running_requests=48,
              burst_gap_s=0, checkpoint_interval=0)
    return Engine(EngineConfig(**kw)), Engine(EngineConfig(disable_radix_cache=True, **kw)), kw


def toks(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(300, 4000) for _ in range(n)]


def test_match_below_every_checkpoint_never_reuses_kv(engines):
    on, off, _ = engines
    x = toks(1, 300)
    run(on, [req("a", x)])                         # checkpoints: prompt end (288) and the decode tail
    b = x[:200] + toks(2, 60)                      # KV matches 192 tokens, but no state there
    recomputed = on.pages.stats()["state_recomputed_tokens_total"]    # the engine is shared by the module
    got, meta = run(on, [req("b", b)])
    want, _ = run(off, [req("b", b)])
    assert meta["b"] == 0 and got == want
    assert on.pages.stats()["state_recomputed_tokens_total"] - recomputed == 192
    c = x[:200] + toks(3, 60)                      # b checkpointed its branching point: c resumes there
    got, meta = run(on, [req("c", c)])
    want, _ = run(off, [req("c", c)])
    assert meta["c"] == 192 and got == want


def test_multi_turn_resumes_at_the_end_of_the_previous_turn(engines):
    on, off, _ = engines
    turn1 = toks(4, 400)
    a_on, _ = run(on, [req("t1", turn1, 20)])
    a_off, _ = run(off, [req("t1", turn1, 20)])
    assert a_on == a_off
    turn2 = turn1 + a_on["t1"] + toks(5, 50)
    b_on, meta = run(on, [req("t2", turn2, 16)])
    b_off, _ = run(off, [req("t2", turn2, 16)])
    assert b_on == b_off
    # 419 tokens had KV when turn 1 ended; the decode tail checkpoint sits at the last page boundary
    assert meta["t2"] == 416


def test_forty_request_shared_prefix_batch(engines):
    on, off, _ = engines
    pre = toks(6, 500)
    sufs = [toks(100 + i, 30) for i in range(40)]
    before = on.counters["prefill_tokens_computed_total"]      # the engine is shared by the module
    first_on, meta0 = run(on, [req("p0", pre + sufs[0])])
    rest_on, meta = run(on, [req(f"p{i}", pre + s) for i, s in enumerate(sufs) if i])
    first_off, _ = run(off, [req("p0", pre + sufs[0])])
    rest_off, _ = run(off, [req(f"p{i}", pre + s) for i, s in enumerate(sufs) if i])
    assert first_on == first_off and rest_on == rest_off
    # the first sibling pays for the branching point once; the others resume there
    assert sorted(meta.values()).count(496) >= 38
    computed = sum(530 - cached for cached in (*meta0.values(), *meta.values()))
    assert on.counters["prefill_tokens_computed_total"] - before == computed


def test_siblings_arriving_together_compute_the_preamble_once(engines):
    """An agent's fan-out arriving in one burst on an empty cache: the first sibling is granted, the
    rest wait for its preamble, and the point where they part becomes one of its checkpoints, so
    the second sibling resumes there instead of recomputing the whole preamble to create it."""
    on, off, _ = engines
    pre = toks(7, 500)                                  # the siblings part at 500: checkpoint at 496
    sufs = [toks(200 + i, 40) for i in range(12)]
    before = on.counters["prefill_tokens_computed_total"]
    got, meta = run(on, [req(f"s{i}", pre + s) for i, s in enumerate(sufs)])
    want, _ = run(off, [req(f"s{i}", pre + s) for i, s in enumerate(sufs)])
    assert got == want
    assert sorted(meta.values()) == [0] + [496] * 11
    assert on.counters["prefill_tokens_computed_total"] - before == 540 + 11 * 44


def test_evicting_states_keeps_kv_and_outputs(models, engines):
    _, off, kw = engines
    # 2 slots per running request + 2 for checkpoints: checkpoints must be evicted, pages need not be
    tight = Engine(EngineConfig(**(kw | {"max_running_requests": 4, "state_slots": 10})))
    prompts = [toks(200 + i, 160) for i in range(6)]
    def reqs(tag):
        return [req(f"{tag}{i}", p) for i, p in enumerate(prompts)] + \
            [req(f"{tag}x{i}", p[:150] + toks(300 + i, 20)) for i, p in enumerate(prompts)]
    got, _ = run(tight, reqs("r"))
    want, _ = run(off, reqs("r"))
    assert got == want
    st = tight.pages.stats()
    assert st["evicted_states_total"] > 0 and st["evicted_pages_total"] == 0


def test_fork_point_checkpoint_hook(engines):
    """The programs issue's hook: a request may ask for checkpoints at fork points of its prompt."""
    on, off, _ = engines
    x = toks(400, 260)
    r = req("fork", x)
    r.checkpoint_at = [100]
    steps = on.steps
    run(on, [r])
    # the checkpoints at 96 and at the prompt's last page boundary (256) are copied out inside the
    # one prefill step (ForwardBatch.taps), not by cutting it: one prefill step and 7 decode steps
    assert on.steps - steps == 1 + 7
    y = x[:110] + toks(401, 40)                      # diverges after the fork point
    got, meta = run(on, [req("child", y)])
    want, _ = run(off, [req("child", y)])
    assert meta["child"] == 96 and got == want       # 100 rounded down to its page boundary


def test_padded_prefill_of_similar_sequences_equals_one_by_one(models, monkeypatch):
    """A prefill's sequences of similar length share one padded chunked-rule call per layer (the
    padding writes nothing into the state): the greedy tokens are those of one call per sequence."""
    import random

    from radixflow.kernels import packing
    from radixflow.kernels.gated_delta_rule import packed
    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.shared.messages import ExecRequest, SamplingParams
    calls = []
    padded = packed._padded
    monkeypatch.setattr(packed, "_padded", lambda *a, **k: calls.append(1) or padded(*a, **k))

    def run(waste: float) -> dict[str, list[int]]:
        monkeypatch.setattr(packing, "PAD_WASTE", waste)
        # the torch references' padding is what is tested (the CPU kernels run a sequence a task)
        e = Engine(EngineConfig(model=models["tiny-hybrid"], max_running_requests=16, burst_gap_s=0,
                                max_total_tokens=16384, kernels="torch"))
        rng = random.Random(0)
        for i in range(6):
            e.add(ExecRequest(rid=f"r{i}", input_ids=[rng.randrange(300, 4000) for _ in range(90 + 7 * i)],
                              sampling=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
        out: dict[str, list[int]] = {}
        while e.has_work():
            for _, o in e.step():
                out.setdefault(o.rid, []).extend(o.token_ids)
        return out
    together = run(1.25)
    assert calls, "the padded path did not run"
    n = len(calls)
    alone = run(0.0)
    assert len(calls) == n and together == alone and all(len(v) == 12 for v in together.values())
