"""The executor's Engine without a bus: continuous batching, sampling, stopping, memory."""
from __future__ import annotations

import pytest

from radixflow.services.executor import engine as engine_mod
from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.shared.errors import BadRequest
from radixflow.shared.messages import ExecRequest, SamplingParams


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def engine(request, models):
    return Engine(EngineConfig(model=models[request.param], page_size=16, max_total_tokens=16384,
                               max_running_requests=8, max_prefill_tokens=2048))


def req(rid: str, ids: list[int], **sp) -> ExecRequest:
    return ExecRequest(rid=rid, input_ids=ids, sampling=SamplingParams(**({"temperature": 0.0} | sp)),
                       eos_token_ids=[0, 2])


def run(engine: Engine, reqs: list[ExecRequest], join_after: dict[int, list[ExecRequest]] | None = None):
    """Drive the engine to completion; requests in join_after[k] are added after step k."""
    for r in reqs:
        engine.add(r)
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    batch_sizes = []
    step = 0
    while engine.has_work():
        for r in (join_after or {}).pop(step, []):
            engine.add(r)
        outs = engine.step()
        batch_sizes.append(len(outs))
        for _, o in outs:
            out.setdefault(o.rid, []).extend(o.token_ids)
            if o.finished:
                reasons[o.rid] = o.finish_reason
        step += 1
    return out, reasons, batch_sizes


def no_leak(engine: Engine) -> bool:
    """Every page is free or cached: none is still held for a finished request."""
    st = engine.pages.stats()
    return st["requests_held"] == 0 and st["kv_pages_private"] == 0 and st["kv_pages_free"] + st["kv_pages_cached"] == st["kv_pages_total"]


def prompt(seed: int, n: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(3, 8000) for _ in range(n)]


def test_batched_greedy_equals_alone_and_requests_join_midway(engine):
    alone = {}
    for i in range(4):
        o, reasons, _ = run(engine, [req(f"a{i}", prompt(i, 20 + 7 * i), max_new_tokens=10, ignore_eos=True)])
        alone[f"a{i}"] = o[f"a{i}"]
        assert reasons[f"a{i}"] == "length" and len(o[f"a{i}"]) == 10
    # two start together, two join while the first two are decoding
    o, _, sizes = run(engine, [req("a0", prompt(0, 20), max_new_tokens=10, ignore_eos=True),
                               req("a1", prompt(1, 27), max_new_tokens=10, ignore_eos=True)],
                      join_after={3: [req("a2", prompt(2, 34), max_new_tokens=10, ignore_eos=True),
                                      req("a3", prompt(3, 41), max_new_tokens=10, ignore_eos=True)]})
    assert o == alone
    assert max(sizes) >= 2            # decode really ran batched
    assert no_leak(engine)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    p = prompt(5, 30)
    a, _, _ = run(engine, [req("s", p, temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=12, ignore_eos=True)])
    b, _, _ = run(engine, [req("s", p, temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_new_tokens=12, ignore_eos=True),
                           req("other", prompt(6, 50), temperature=1.0, seed=7, max_new_tokens=12, ignore_eos=True)])
    c, _, _ = run(engine, [req("s", p, temperature=0.9, top_p=0.95, top_k=50, seed=99, max_new_tokens=12, ignore_eos=True)])
    assert a["s"] == b["s"]
    assert a["s"] != c["s"]


def test_stop_token_ids_and_eos(engine):
    p = prompt(8, 25)
    free, _, _ = run(engine, [req("f", p, max_new_tokens=12, ignore_eos=True)])
    stop_at = free["f"][4]
    o, reasons, _ = run(engine, [req("f", p, max_new_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)])
    first = free["f"].index(stop_at)
    assert o["f"] == free["f"][: first + 1] and reasons["f"] == "stop"
    # the same token as an EOS id stops too, unless ignore_eos
    r = ExecRequest(rid="e", input_ids=p, sampling=SamplingParams(temperature=0, max_new_tokens=12), eos_token_ids=[stop_at])
    o, reasons, _ = run(engine, [r])
    assert o["e"] == free["f"][: first + 1] and reasons["e"] == "stop"


def test_abort_frees_memory(engine):
    engine.add(req("x", prompt(9, 40), max_new_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(["x"])
    outs = engine.step()
    assert [(o.rid, o.finish_reason) for _, o in outs if o.finished] == [("x", "abort")]
    assert not engine.has_work()
    assert no_leak(engine)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine):
    """Fault injection: the model step raises once (a bug, a kernel error). Every request of that
    step ends with an error, nothing leaks, and the next requests are served as before."""
    want, _, _ = run(engine, [req("ok-before", prompt(31, 20), max_new_tokens=4, ignore_eos=True)])
    real = engine.runner.run

    def broken(plan):
        engine.runner.run = real
        raise RuntimeError("injected")
    engine.runner.run = broken
    engine.add(req("a", prompt(32, 20), max_new_tokens=4))
    engine.add(req("b", prompt(33, 20), max_new_tokens=4))
    outs = []
    while engine.has_work():
        outs += [o for _, o in engine.step()]
    failed = {o.rid: o for o in outs if o.finished}
    assert set(failed) == {"a", "b"} and all(o.error and "injected" in o.error and o.error_code == 500
                                             for o in failed.values())
    assert no_leak(engine)
    again, _, _ = run(engine, [req("ok-after", prompt(31, 20), max_new_tokens=4, ignore_eos=True)])
    assert again["ok-after"] == want["ok-before"]


def test_bad_requests_are_refused(engine):
    with pytest.raises(BadRequest, match="empty"):
        engine.add(req("e", []))
    with pytest.raises(BadRequest, match="vocabulary"):
        engine.add(req("v", [engine.spec.vocab_size + 5]))
    with pytest.raises(BadRequest, match="context length"):
        engine.add(req("l", [5] * 10, max_new_tokens=engine.max_model_len))
    with pytest.raises(BadRequest, match="pool holds"):
        engine.add(req("p", [5] * 10, max_new_tokens=20000))


def test_more_requests_than_memory_queue_and_all_finish(models):
    small = Engine(EngineConfig(model=models["tiny-hybrid"], page_size=16, max_total_tokens=512,
                                max_running_requests=8, max_prefill_tokens=2048))
    reqs = [req(f"q{i}", prompt(20 + i, 100), max_new_tokens=20, ignore_eos=True) for i in range(8)]
    o, reasons, sizes = run(small, reqs)
    assert sorted(o) == sorted(r.rid for r in reqs) and all(len(v) == 20 for v in o.values())
    assert max(sizes) <= 4            # 512 tokens hold at most 4 requests of 120 at a time
    assert no_leak(small)


def test_engine_greedy_equals_transformers_generate(engine):
    """The whole engine path (paging, cascade attention over contiguous and shared pages, batching,
    a cached prefix) against transformers' own greedy generation."""
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(engine.cfg.model, dtype=torch.float32).eval()
    base = prompt(40, 200)
    prompts = [base + prompt(41, 30), base + prompt(42, 45), prompt(43, 150)]
    want = []
    for p in prompts:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    got, _, _ = run(engine, [req("p0", prompts[0], max_new_tokens=12, ignore_eos=True)])   # caches `base`
    more, _, _ = run(engine, [req(f"p{i}", p, max_new_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    assert got["p0"] == want[0]
    assert [more[f"p{i}"] for i in range(3)] == want


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_mixed_prefill_decode_steps_change_no_output_and_keep_decoding(models, name):
    """Long prompts arrive while short requests decode. With mixed steps (chunked prefill carrying a
    row of every decoding request) the decoding requests get a token in every step while the long
    prompts prefill; without, they wait for whole prefill steps. Greedy tokens are the same."""
    def engine(mixed: int) -> Engine:
        return Engine(EngineConfig(model=models[name], page_size=16, max_total_tokens=16384, max_running_requests=8,
                                   max_prefill_tokens=2048, mixed_chunk_tokens=mixed))
    shared = prompt(99, 600)
    short = [req(f"s{i}", prompt(i, 20), max_new_tokens=24, ignore_eos=True) for i in range(3)]
    long = [req("l0", prompt(50, 1200), max_new_tokens=4, ignore_eos=True),
            req("l1", shared + prompt(51, 300), max_new_tokens=4, ignore_eos=True),
            req("l2", shared + prompt(52, 250), max_new_tokens=4, ignore_eos=True)]
    results = {}
    for mixed in (256, 0):
        e = engine(mixed)
        for r in short:
            e.add(r)
        out: dict[str, list[int]] = {}
        done: set[str] = set()
        waits = 0        # steps in which a running short request got no token
        step = 0
        while e.has_work():
            if step == 3:
                for r in long:
                    e.add(r)
            got = set()
            for _, o in e.step():
                out.setdefault(o.rid, []).extend(o.token_ids)
                got.add(o.rid)
                if o.finished:
                    done.add(o.rid)
            if step >= 3:
                waits += sum(1 for r in short if r.rid not in done and r.rid not in got)
            step += 1
        assert no_leak(e)
        results[mixed] = (out, waits, e.mixed_steps)
    (on, on_waits, on_mixed), (off, off_waits, off_mixed) = results[256], results[0]
    assert on == off and all(len(on[r.rid]) == 24 for r in short) and all(len(on[r.rid]) == 4 for r in long)
    assert on_mixed >= 3 and off_mixed == 0
    # without mixing the short requests wait out the prefill steps (the admission step, where the
    # long prompts join, may still be a decode of the short ones); with it, never
    assert on_waits == 0 and off_waits >= 2


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_overlap_changes_no_output(models, name):
    """With overlap, the exchange with the page authority (admissions, progress, releases) travels
    while a step computes and its admissions join the next step; without, the step waits for it.
    Requests arriving while others decode, some sharing a prefix and some finishing early: greedy
    tokens are the same either way, and nothing leaks."""
    shared = prompt(77, 300)
    first = [req(f"a{i}", prompt(60 + i, 40), max_new_tokens=20, ignore_eos=True) for i in range(3)]
    later = [req(f"b{i}", shared + prompt(70 + i, 30 + 7 * i), max_new_tokens=6 + i, ignore_eos=True) for i in range(4)]
    results = {}
    for overlap in (True, False):
        e = Engine(EngineConfig(model=models[name], page_size=16, max_total_tokens=16384, max_running_requests=8,
                                overlap=overlap, burst_gap_s=0))
        for r in first:
            e.add(r)
        out: dict[str, list[int]] = {}
        step = 0
        while e.has_work():
            if step in (2, 5):
                for r in later[:2] if step == 2 else later[2:]:
                    e.add(r)
            for _, o in e.step():
                out.setdefault(o.rid, []).extend(o.token_ids)
            step += 1
        assert no_leak(e)
        results[overlap] = (out, e.overlapped)
    (on, n_on), (off, n_off) = results[True], results[False]
    assert on == off and len(on) == 7 and all(len(on[r.rid]) == r.sampling.max_new_tokens for r in first + later)
    assert n_on >= 5 and n_off == 0


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_siblings_join_the_step_right_after_their_shared_prefill(models, name):
    """An agent's fan-out: the first request prefills the preamble while its siblings wait for it
    ("shared-prefix"). With overlap the step after that prefill waits for its exchange, so that the
    siblings are granted into it: no step decodes the first request alone."""
    pre = prompt(91, 200)
    e = Engine(EngineConfig(model=models[name], page_size=16, max_total_tokens=16384, max_running_requests=8,
                            burst_gap_s=0))
    for i in range(4):
        e.add(req(f"s{i}", pre + prompt(92 + i, 20), max_new_tokens=3, ignore_eos=True))
    plans = []
    run_plan = e.runner.run
    e.runner.run = lambda plan: plans.append((plan.is_decode, [s.rid for s in plan.seqs])) or run_plan(plan)
    out: dict[str, list[int]] = {}
    while e.has_work():
        for _, o in e.step():
            out.setdefault(o.rid, []).extend(o.token_ids)
    assert plans[0] == (False, ["s0"])                            # the preamble, once
    assert not plans[1][0] and set(plans[1][1]) == {"s0", "s1", "s2", "s3"}   # the siblings join at once
    assert e.counters["cached_tokens_total"] >= 3 * 192 and all(len(v) == 3 for v in out.values())
    assert e.overlapped > 0 and no_leak(e)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_siblings_that_arrive_during_the_first_exchange_cost_no_exchange_of_their_own(models, name):
    """The first request of a fan-out is granted alone and its siblings arrive while that exchange
    travels: they would wait for the preamble it is about to compute anyway, so the step computes at
    once, without another round trip for them, and they are granted into the step after it (as when
    they arrive together). On a hybrid model too: the first one's grant is final (asking now would
    add no checkpoint where they part), so one sibling then computes to that point and the others
    resume there. An unrelated request is asked for at once."""
    pre = prompt(93, 200)
    reqs = [req(f"s{i}", pre + prompt(94 + i, 20), max_new_tokens=3, ignore_eos=True) for i in range(4)]

    def fresh():
        return Engine(EngineConfig(model=models[name], page_size=16, max_total_tokens=16384, max_running_requests=8,
                                   burst_gap_s=0))

    def serve(e, late):
        sends, plans, out = [], [], {}
        send = e.pages.send

        def arrive_then_send(msg):
            sends.append(len(plans))
            if len(sends) == 1:
                for r in late:
                    e.add(r)
            return send(msg)
        e.pages.send = arrive_then_send
        run_plan = e.runner.run
        e.runner.run = lambda plan: plans.append((plan.is_decode, [s.rid for s in plan.seqs])) or run_plan(plan)
        e.add(reqs[0])
        while e.has_work():
            for _, o in e.step():
                out.setdefault(o.rid, []).extend(o.token_ids)
        return sends, plans, out

    e = fresh()
    sends, plans, out = serve(e, reqs[1:])
    assert sends[:2] == [0, 1]                  # one exchange before the preamble's step
    assert plans[0] == (False, ["s0"])
    if name == "tiny-dense":
        assert not plans[1][0] and set(plans[1][1]) == {"s0", "s1", "s2", "s3"}
        assert e.counters["cached_tokens_total"] >= 3 * 192
    else:   # one sibling computes to where they part (the preamble has no state there), then the others
        assert not plans[1][0] and len(set(plans[1][1]) - {"s0"}) == 1
        assert not plans[2][0] and len(set(plans[2][1]) - {"s0"} - set(plans[1][1])) == 2
        assert e.counters["cached_tokens_total"] >= 2 * 192
    assert no_leak(e)
    assert out == run(fresh(), reqs)[0]                      # as when they arrive together
    e = fresh()
    other = req("x", prompt(99, 220), max_new_tokens=3, ignore_eos=True)
    sends, plans, _ = serve(e, [other])
    assert sends[:2] == [0, 0] and set(plans[0][1]) == {"s0", "x"}   # asked for at once, joins at once
    assert no_leak(e)


@pytest.mark.parametrize("overlap", [True, False])
def test_more_requests_than_running_slots_all_finish(models, overlap):
    """Requests beyond max_running_requests wait and are admitted as others finish. With overlap a
    batch can finish after the step's message was sent; the waiting ones must still be asked for
    again (they once were not: the engine reported no work while 8 of them waited forever)."""
    e = Engine(EngineConfig(model=models["tiny-dense"], page_size=16, max_total_tokens=16384, max_running_requests=4,
                            overlap=overlap, burst_gap_s=0))
    for i in range(12):
        e.add(req(f"q{i}", prompt(300 + i, 24), max_new_tokens=2))
    done, steps = set(), 0
    while e.has_work() and steps < 200:
        done |= {o.rid for _, o in e.step() if o.finished}
        steps += 1
    assert len(done) == 12 and e.num_waiting == 0 and no_leak(e)


def test_a_quiet_request_reports_its_first_output_and_its_end_only(engine):
    """ExecRequest.quiet (no stream, no stop strings: the scheduler makes the text at the end): the
    executor publishes the first output (time to first token) and the last, which carries every
    token in between at the right offset; the tokens are those of the same request reported each
    step, also with logprobs, and also when it is aborted midway."""
    import msgspec

    def outputs(r: ExecRequest, abort_after: int = 0) -> list:
        engine.add(r)
        got, steps = [], 0
        while engine.has_work():
            got += [o for _, o in engine.step() if o.rid == r.rid]
            steps += 1
            if abort_after and steps == abort_after:
                engine.abort([r.rid])
        return got

    base = req("loud", prompt(31, 40), max_new_tokens=12, ignore_eos=True, logprobs=True)
    loud = outputs(base)
    quiet = outputs(msgspec.structs.replace(base, rid="quiet", quiet=True))
    assert len(loud) == 12 and len(quiet) == 2
    assert [o.offset for o in quiet] == [0, 1] and quiet[-1].finished and not quiet[0].finished
    assert sum((o.token_ids for o in quiet), []) == sum((o.token_ids for o in loud), [])
    # (the second run reads the first one's cached prompt: logprobs equal to float rounding)
    assert sum((o.logprobs for o in quiet), []) == pytest.approx(sum((o.logprobs for o in loud), []), abs=1e-4)
    cut = outputs(msgspec.structs.replace(base, rid="cut", quiet=True), abort_after=5)
    assert len(cut) == 2 and cut[-1].finish_reason == "abort"
    ids = sum((o.token_ids for o in cut), [])
    assert 1 < len(ids) < 12 and ids == sum((o.token_ids for o in loud), [])[:len(ids)]
    assert no_leak(engine)


def test_a_long_prompt_does_not_wait_for_an_announced_burst(models):
    """A request that announces more to come (ExecRequest.burst) makes an idle engine wait for them,
    up to burst_wait_s, so that a burst is prefilled together; but once the prompt tokens in hand
    fill a step (burst_enough_tokens), the step starts: the first step prefills this request
    although the announced one never comes. Below that size the engine still waits for it."""
    for enough, long in ((64, True), (4096, False)):
        e = Engine(EngineConfig(model=models["tiny-dense"], page_size=16, max_total_tokens=16384,
                                burst_gap_s=0.002, burst_wait_s=0.5, burst_enough_tokens=enough))
        r = req("long", prompt(5, 100), max_new_tokens=2)
        r.burst = 1
        e.add(r)
        waited = []
        sleep = engine_mod.time.sleep
        engine_mod.time.sleep = lambda s: waited.append(s) or sleep(s)
        try:
            outs = e.step()
        finally:
            engine_mod.time.sleep = sleep
        assert [o.rid for _, o in outs] == ["long"]
        assert (not waited) == long


def test_a_mixed_prefill_leaves_no_remainder_step_of_a_few_tokens():
    """Chunked prefill beside decode rows: the last chunk may run up to an eighth over the mixed budget
    rather than leave a few tokens to a step of their own (an agent's 38 siblings went as 2,048 +
    2,048 + 66); a prefill well over the budget is still cut at it."""
    from radixflow.services.executor.batcher import Batcher
    from radixflow.services.executor.sequence import Sequence

    def batcher(prompt_lens: list[int]) -> Batcher:
        b = Batcher(pool="p", max_running=64, max_prefill_tokens=8192, mixed_chunk_tokens=256)
        dec = Sequence(rid="d", tokens=list(range(10)), sampling=SamplingParams(), eos_ids=frozenset())
        dec.computed_len = dec.prefill_len          # decoding
        b.running.append(dec)
        for i, n in enumerate(prompt_lens):
            b.running.append(Sequence(rid=f"p{i}", tokens=list(range(n)), sampling=SamplingParams(), eos_ids=frozenset()))
        return b

    def chunks(b: Batcher) -> list[int]:
        out = []
        while (plan := b.schedule()) is not None and not plan.is_decode:
            assert plan.mixed and "d" in [s.rid for s in plan.seqs]     # the decode rows ride along
            out.append(sum(n for s, n in zip(plan.seqs, plan.extend_lens) if s.computed_len < s.prefill_len))
            for s, n in zip(plan.seqs, plan.extend_lens):
                if s.computed_len < s.prefill_len:
                    s.computed_len += n
        return out

    # the budget is 256 less the decode rows (one, then those done prefilling): 255, and an eighth 31
    assert chunks(batcher([100, 100, 70])) == [270]          # 15 over: one step
    assert chunks(batcher([100, 100, 100])) == [255, 45]     # 45 over: cut at the budget
    assert chunks(batcher([200, 200, 140])) == [255, 285]    # the rest 30 over: no third step
