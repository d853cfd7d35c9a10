"""A pool that runs out mid-generation (issue 13): with decode_reserve, a request reserves only part
of its output at admission, grows page by page, and is preempted when no page is left: back to
waiting with every token it has, its computed tokens cached, resumed by recomputing them (mostly
from the cache). Greedy outputs equal those of full reservation, and nothing leaks."""
from __future__ import annotations

import pytest

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.radix.pool import PagePool
from radixflow.shared.messages import Candidate, RadixStep, Release

from .test_engine import no_leak, prompt, req


def drive(engine: Engine, reqs) -> tuple[dict[str, list[int]], int]:
    for r in reqs:
        engine.add(r)
    out: dict[str, list[int]] = {}
    most = 0
    while engine.has_work():
        for _, o in engine.step():
            assert not o.error, o.error
            out.setdefault(o.rid, []).extend(o.token_ids)
        most = max(most, engine.num_running)
    return out, most


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_requests_resume_with_the_same_tokens(models, model, overlap):
    # 20 pages of 16 tokens; 5 requests of 40-token prompts and 72 new tokens: 7 pages each with
    # everything reserved (two run at once), 4 pages each with 16 reserved (all five start, then
    # the pool runs out as they grow)
    kw = dict(model=models[model], page_size=16, max_total_tokens=20 * 16, max_running_requests=8,
              max_prefill_tokens=2048, overlap=overlap, warmup_tokens=0)
    reqs = lambda: [req(f"r{i}", prompt(40 + i, 40), max_new_tokens=72, ignore_eos=True) for i in range(5)]
    full = Engine(EngineConfig(**kw, decode_reserve=0))
    want, most_full = drive(full, reqs())
    small = Engine(EngineConfig(**kw, decode_reserve=16))
    got, most_small = drive(small, reqs())
    assert got == want and all(len(v) == 72 for v in got.values())
    assert small.preempted > 0 and most_small > most_full == 2
    assert no_leak(small) and no_leak(full)
    st = small.stats()
    assert st["requests_total"] == 5 and st["preempted_total"] == small.preempted


def test_a_grant_never_hands_out_pages_an_earlier_grant_of_the_same_admission_evicted():
    """Matches are found for every candidate first; a grant that evicts a cached prefix to get its
    own pages must not leave a later candidate holding that prefix's (freed) pages."""
    pool = PagePool(8, 4)
    x = list(range(10, 18))                                  # two pages, cached then unlocked
    pool.step(RadixStep(pool="p", budget=100, max_admit=4, candidates=[
        Candidate(rid="x", namespace="n", token_ids=x + [1], reserve=0)]))
    pool.step(RadixStep(pool="p", budget=100, max_admit=4, releases=[Release(rid="x", output_ids=[], computed=9)]))
    assert pool.match_len("n", x + [2]) == 8
    a = Candidate(rid="a", namespace="n", token_ids=list(range(100, 125)), reserve=0, priority=1)   # 7 pages
    b = Candidate(rid="b", namespace="n", token_ids=x + [3, 4], reserve=0)                         # reuses x
    reply = pool.step(RadixStep(pool="p", budget=100, max_admit=4, candidates=[a, b]))
    pages = [p for g in reply.grants for p in g.pages]
    assert len(pages) == len(set(pages)), reply.grants
    assert [g.rid for g in reply.grants] == ["a"]            # b waits: its prefix was evicted for a


@pytest.mark.parametrize("overlap", [False, True])
def test_a_waiting_request_sends_its_prompt_to_the_pool_once(models, overlap):
    """A burst sharing a preamble waits steps for it (shared-prefix): each prompt goes to the pool
    in the first message only, later ones name the request (Candidate.known); a pool that forgets
    the prompts it kept defers those as "unknown" and gets them again, with the same outputs."""
    from radixflow.services.executor import pages as P
    kw = dict(model=models["tiny-dense"], page_size=16, max_total_tokens=64 * 16, max_running_requests=8,
              max_prefill_tokens=512, overlap=overlap, warmup_tokens=0)
    pre = prompt(7, 200)
    reqs = lambda: [req(f"r{i}", pre + prompt(100 + i, 20), max_new_tokens=4, ignore_eos=True) for i in range(6)]
    sent, known = {}, {}

    class Counting(P.LocalPages):
        def step(self, msg):
            for c in msg.candidates:
                sent[c.rid] = sent.get(c.rid, 0) + bool(c.token_ids)
                known[c.rid] = known.get(c.rid, 0) + c.known
            return super().step(msg)

    unknown = []

    class Forgetful(P.LocalPages):
        def step(self, msg):
            self.pool._kept = {}
            reply = super().step(msg)
            unknown.extend(d.rid for d in reply.deferred if d.reason == "unknown")
            return reply
    got, _ = drive(Engine(EngineConfig(**kw), pages=Counting()), reqs())
    want, _ = drive(Engine(EngineConfig(**kw), pages=Forgetful()), reqs())
    assert got == want and all(len(v) == 4 for v in got.values())
    assert unknown
    assert sent == {f"r{i}": 1 for i in range(6)}
    assert sum(known.values()) >= 5         # the five that waited for the preamble asked again by name


def test_admission_waits_for_the_requests_a_burst_announced(models):
    """ExecRequest.burst: the scheduler still held that many submissions when it sent this one.
    Admission waits for them (here with no gap wait at all, so without the announcement the first
    request would be admitted alone), and stops waiting at burst_wait_s for any that never come."""
    import threading
    import time
    from radixflow.services.executor import pages as P
    firsts = []

    class Counting(P.LocalPages):
        def step(self, msg):
            if msg.candidates and not firsts:
                firsts.append(len(msg.candidates))
            return super().step(msg)
    kw = dict(model=models["tiny-dense"], page_size=16, max_total_tokens=64 * 16, max_running_requests=8,
              warmup_tokens=0, burst_gap_s=0.0)
    e = Engine(EngineConfig(**kw, burst_wait_s=30.0), pages=Counting())
    pre = prompt(3, 64)
    reqs = [req(f"r{i}", pre + [5 + i], max_new_tokens=2, ignore_eos=True) for i in range(3)]
    reqs[0].burst = 2
    e.add(reqs[0])
    t = threading.Thread(target=e.step)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not firsts           # waiting for the two announced
    e.add(reqs[1])
    e.add(reqs[2])
    t.join(30)
    assert firsts == [3]
    e2 = Engine(EngineConfig(**kw, burst_wait_s=0.2), pages=P.LocalPages())
    r = req("lone", pre, max_new_tokens=1, ignore_eos=True)
    r.burst = 5                                  # announced, never sent: the wait ends at burst_wait_s
    e2.add(r)
    e2.step()
    assert e2._expect == 0


def test_prompts_go_in_full_to_an_authority_that_does_not_take_known_candidates(models):
    """A radix from before Candidate.known would read an elided prompt as an empty one: the
    executor elides prompts only when registration said the authority takes them."""
    from radixflow.services.executor import pages as P
    seen = []

    class Old(P.LocalPages):
        def register(self, msg):
            super().register(msg)
            return False

        def step(self, msg):
            seen.extend((bool(c.token_ids), c.known) for c in msg.candidates)
            return super().step(msg)
    kw = dict(model=models["tiny-dense"], page_size=16, max_total_tokens=64 * 16, max_running_requests=8,
              max_prefill_tokens=512, warmup_tokens=0)
    pre = prompt(7, 200)
    got, _ = drive(Engine(EngineConfig(**kw), pages=Old()),
                   [req(f"r{i}", pre + prompt(100 + i, 20), max_new_tokens=2, ignore_eos=True) for i in range(4)])
    assert len(got) == 4 and len(seen) > 4 and all(sent and not known for sent, known in seen)
