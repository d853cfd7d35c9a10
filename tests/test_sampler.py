"""The batched sampler: logit_bias, penalties, the vectorized filters against the per-row reference,
seeded reproducibility whatever the batch; and logprobs / penalties through the whole engine,
checked against transformers' own forward pass."""
from __future__ import annotations

import math
import random

import pytest
import torch
from radixflow.services.executor import sampler
from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.executor.sequence import Sequence
from radixflow.shared.messages import ExecRequest, SamplingParams

NINF = float("-inf")


def seq(prompt: list[int], output: list[int] = (), **sp) -> Sequence:
    s = Sequence(rid=f"r{random.random()}", tokens=list(prompt) + list(output),
                 sampling=SamplingParams(**({"temperature": 0.0} | sp)), eos_ids=frozenset())
    s.prompt_len = len(prompt)
    return s


def greedy_after(logits: list[float], s: Sequence) -> tuple[int, list[float]]:
    """One greedy row through the sampler: its token and the logits it saw (the sampler works in place)."""
    x = torch.tensor([logits])
    tok = sampler.sample(x, [s]).tokens[0]
    return tok, x[0].tolist()


# ---------------------------------------------------------------- biases and penalties


def test_logit_bias_forces_and_forbids_tokens_in_its_row_only():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g)
    best = x.argmax(-1).tolist()
    second = x.topk(2).indices[:, 1].tolist()
    rows = [seq([1]), seq([1], logit_bias={7: 100.0}), seq([1], logit_bias={best[2]: -100.0})]
    assert sampler.sample(x.clone(), rows).tokens == [best[0], 7, second[2]]


FREQ_LOGITS = [0.0, 5.0, 4.6, 4.3, 1.0, 0.0]      # output so far [1, 1, 2]; token 3 is in the prompt only


@pytest.mark.parametrize("kw, want_tok, want", [
    ({"frequency_penalty": 0.3}, 1, [0.0, 4.4, 4.3, 4.3, 1.0, 0.0]),
    ({"frequency_penalty": 0.5}, 3, [0.0, 4.0, 4.1, 4.3, 1.0, 0.0]),
    ({"presence_penalty": 0.5}, 1, [0.0, 4.5, 4.1, 4.3, 1.0, 0.0]),
    ({"presence_penalty": 0.8}, 3, [0.0, 4.2, 3.8, 4.3, 1.0, 0.0]),
    ({"presence_penalty": 0.5, "frequency_penalty": 0.3}, 3, [0.0, 3.9, 3.8, 4.3, 1.0, 0.0]),
])
def test_frequency_and_presence_penalties_count_output_tokens_only(kw, want_tok, want):
    tok, got = greedy_after(FREQ_LOGITS, seq([3, 4], [1, 1, 2], **kw))
    assert tok == want_tok
    assert got == pytest.approx(want, abs=1e-6)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    # token 0 in the prompt (positive), token 1 in the output (negative); 2 and 3 unseen
    tok, got = greedy_after([2.0, -2.0, 1.5, -1.0], seq([0], [1], repetition_penalty=2.0))
    assert got == pytest.approx([1.0, -4.0, 1.5, -1.0])
    assert tok == 2


def test_penalty_counts_follow_the_output_across_steps_and_batches():
    """The counts are kept incrementally: a sequence sampled in different batches, with tokens
    appended between steps, is penalized by its whole output each time."""
    a = seq([9], [1], frequency_penalty=1.0)
    b = seq([9], [], presence_penalty=1.0, repetition_penalty=1.5)
    c = seq([9], [])                                   # unpenalized: shares the batch, untouched
    base = [0.0, 3.0, 2.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    x = torch.tensor([base] * 3)
    assert sampler.sample(x, [a, b, c]).tokens == [2, 1, 1]
    assert x[2].tolist() == base
    for s, t in ((a, 2), (b, 1)):
        s.tokens.append(t)
    a.tokens.append(1)                                 # a: output [1, 2, 1] -> counts {1: 2, 2: 1}
    x = torch.tensor([base])
    assert sampler.sample(x, [a]).tokens == [9]
    assert x[0].tolist() == pytest.approx([0.0, 1.0, 1.5, 1.0, 0, 0, 0, 0, 0, 2.0])
    x = torch.tensor([base] * 2)
    sampler.sample(x, [c, b])                          # b: output [1]; 9 in its prompt
    assert x[1].tolist() == pytest.approx([0.0, 3.0 / 1.5 - 1.0, 2.5, 1.0, 0, 0, 0, 0, 0, 2.0 / 1.5])


# ---------------------------------------------------------------- filters and the draw


def _random_params(rng: random.Random, n: int, V: int, top_k: bool, top_p: bool, min_p: bool):
    ks = [rng.choice([0, -1, 1, 2, 5, 40, V, V + 3]) if top_k else 0 for _ in range(n)]
    ps = [rng.choice([1.0, 0.5, 0.9, 0.99, 0.1]) if top_p else 1.0 for _ in range(n)]
    ms = [rng.choice([0.0, 0.05, 0.2]) if min_p else 0.0 for _ in range(n)]
    return ks, ps, ms


@pytest.mark.parametrize("top_k, top_p, min_p, all_k", [
    (True, True, True, False), (True, False, False, False), (False, True, False, False),
    (False, False, True, False), (True, True, True, True), (True, True, False, True)])
def test_filter_batch_equals_the_per_row_filter(top_k, top_p, min_p, all_k):
    rng, V = random.Random(hash((top_k, top_p, min_p, all_k)) % 1000), 1000
    g = torch.Generator().manual_seed(1)
    for trial in range(5):
        n = 24
        x = torch.randn(n, V, generator=g) * rng.choice([0.5, 2.0, 5.0])
        ks, ps, ms = _random_params(rng, n, V, top_k, top_p, min_p)
        if all_k:                                       # every row has a top-k: the topk window path
            ks = [rng.choice([1, 3, 17, 64]) for _ in range(n)]
        got = sampler.filter_batch(x.clone(), ks, ps, ms)
        for i in range(n):
            want = sampler.filter_logits(x[i], SamplingParams(temperature=1.0, top_k=ks[i], top_p=ps[i], min_p=ms[i]))
            assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (trial, i, ks[i], ps[i], ms[i])
            torch.testing.assert_close(got[i][~torch.isinf(want)], want[~torch.isinf(want)])
        assert torch.isinf(got).any() or not (top_k or top_p or min_p)


@pytest.mark.parametrize("scale, sorts", [(8.0, False), (0.05, True)])
def test_top_p_takes_its_nucleus_from_a_topk_window_when_it_fits(monkeypatch, scale, sorts):
    """Top-p rows whose nucleus lies within the NUCLEUS_CANDIDATES most likely tokens need no sort
    of the vocabulary (peaked rows); a flat row's wider nucleus falls back to the sort. Either way
    the result is the per-row filter's."""
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 64)
    sorted_ = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorted_.append(1) or real_sort(self, *a, **k))
    rng, V, n = random.Random(3), 1000, 16
    x = torch.randn(n, V, generator=torch.Generator().manual_seed(2)) * scale
    ks = [rng.choice([0, 5, 40]) for _ in range(n)]
    ps = [rng.choice([0.5, 0.9, 0.99]) for _ in range(n)]
    ms = [rng.choice([0.0, 0.05]) for _ in range(n)]
    got = sampler.filter_batch(x.clone(), ks, ps, ms)
    assert bool(sorted_) == sorts
    monkeypatch.undo()
    for i in range(n):
        want = sampler.filter_logits(x[i], SamplingParams(temperature=1.0, top_k=ks[i], top_p=ps[i], min_p=ms[i]))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, ks[i], ps[i], ms[i])
        torch.testing.assert_close(got[i][~torch.isinf(want)], want[~torch.isinf(want)])


def test_draws_follow_the_filtered_distribution():
    """The exponential race samples softmax(logits / T) over what the filters keep."""
    n, V = 20000, 5
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0]]).repeat(n, 1)
    rows = [seq([1], temperature=0.7) for _ in range(n)]
    toks = torch.tensor(sampler.sample(logits.clone(), rows).tokens)
    freq = torch.bincount(toks, minlength=V).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015, rtol=0)
    rows = [seq([1], temperature=1.0, top_k=2) for _ in range(n)]
    toks = torch.tensor(sampler.sample(logits.clone(), rows).tokens)
    freq = torch.bincount(toks, minlength=V).float() / n
    torch.testing.assert_close(freq, torch.tensor([math.e / (math.e + math.e ** 2), 0, 0, 0,
                                                   math.e ** 2 / (math.e + math.e ** 2)]), atol=0.015, rtol=0)


def test_a_seeded_row_draws_the_same_tokens_alone_or_in_any_batch():
    V = 3000
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(6, V, generator=g) for _ in range(20)]
    params = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}

    def draw(make_batch):
        me = seq([1], **params)
        out = []
        for x in steps:
            batch = make_batch(me)
            mine = batch.index(me)
            # its own logits row in every batch; the others get theirs
            rows = [0 if s is me else 1 + j for j, s in enumerate(batch)]
            toks = sampler.sample(x[rows].clone(), batch).tokens
            out.append(toks[mine])
            me.tokens.append(out[-1])
        return out

    alone = draw(lambda me: [me])
    others = [seq([2], temperature=0.7), seq([3], temperature=1.2, top_k=5, seed=7), seq([4]),
              seq([5], temperature=0.9, min_p=0.1, frequency_penalty=0.5, logit_bias={3: 2.0}, logprobs=True)]
    crowded = draw(lambda me: [others[0], me] + others[1:])
    last = draw(lambda me: others + [me])
    assert alone == crowded == last
    assert len(set(alone)) > 5                          # it really samples
    me2 = seq([1], **(params | {"seed": 99}))
    assert [sampler.sample(x[:1].clone(), [me2]).tokens[0] for x in steps] != alone


def test_logprobs_are_of_the_raw_logits_whatever_the_penalties():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, generator=g) * 3
    rows = [seq([1], [5, 5], logprobs=True, top_logprobs=4, frequency_penalty=2.0, logit_bias={0: 50.0}),
            seq([1], temperature=0.5, seed=3, top_logprobs=2),
            seq([1])]
    out = sampler.sample(x.clone(), rows)
    lp = torch.log_softmax(x, -1)
    for i in range(2):
        assert out.logprobs[i] == pytest.approx(lp[i, out.tokens[i]].item(), abs=1e-6)
        k = rows[i].sampling.top_logprobs
        assert out.top[i].ids == lp[i].topk(k).indices.tolist()
        assert out.top[i].logprobs == pytest.approx(lp[i].topk(k).values.tolist(), abs=1e-6)
    assert out.tokens[0] == 0                           # the bias won; its logprob is still the raw one
    assert out.logprobs[2] is None and out.top[2] is None


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
def engine(request, models):
    return Engine(EngineConfig(model=models[request.param], page_size=16, max_total_tokens=16384,
                               max_running_requests=8, max_prefill_tokens=2048))


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(engine.cfg.model, dtype=torch.float32).eval()


def collect(engine: Engine, reqs: list[ExecRequest], abort_after: int = -1) -> dict[str, dict]:
    """Drive the engine to completion; every output's logprobs must line up with its token_ids."""
    for r in reqs:
        engine.add(r)
    got: dict[str, dict] = {r.rid: {"tokens": [], "logprobs": [], "top": []} for r in reqs}
    step = 0
    while engine.has_work():
        if step == abort_after:
            engine.abort([r.rid for r in reqs])
        for _, o in engine.step():
            want = next(r for r in reqs if r.rid == o.rid).sampling
            assert len(o.logprobs) == (len(o.token_ids) if want.logprobs or want.top_logprobs else 0)
            assert len(o.top_logprobs) == (len(o.token_ids) if want.top_logprobs else 0)
            g = got[o.rid]
            g["tokens"] += o.token_ids
            g["logprobs"] += o.logprobs
            g["top"] += o.top_logprobs
            if o.finished:
                g.update(reason=o.finish_reason, cached=o.cached_tokens, input_logprobs=o.input_logprobs,
                         input_top=o.input_top_logprobs)
        step += 1
    return got


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8000) for _ in range(n)]


def lp_req(rid: str, ids: list[int], start: int, **sp) -> ExecRequest:
    return ExecRequest(rid=rid, input_ids=ids, logprob_start=start, checkpoint_at=[48],
                       sampling=SamplingParams(**({"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True,
                                                   "logprobs": True, "top_logprobs": 3} | sp)))


def test_logprobs_equal_a_full_forward_pass_and_survive_a_cache_hit(engine, hf):
    p = prompt(60, 70)
    # in a batch with a sampled request that wants no logprobs
    first = collect(engine, [lp_req("a", p, 0), lp_req("z", prompt(63, 33), -1, temperature=0.8, seed=5,
                                                          logprobs=False, top_logprobs=0)])["a"]
    # the same prompt again, prompt logprobs from 50 on: 48 tokens may come from the cache
    again = collect(engine, [lp_req("b", p, 50)])["b"]
    assert first["cached"] == 0 and again["cached"] > 0
    assert again["tokens"] == first["tokens"] and len(first["tokens"]) == 6
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([p + first["tokens"]])).logits[0].float(), -1)   # [T, V]
    n = len(p)
    for got, start in ((first, 0), (again, 50)):
        # output: the token at n + i is predicted at n - 1 + i
        want = [ref[n - 1 + i, t].item() for i, t in enumerate(got["tokens"])]
        assert got["logprobs"] == pytest.approx(want, abs=1e-4)
        for i, (t, top) in enumerate(zip(got["tokens"], got["top"])):
            assert top.ids[0] == t and top.logprobs[0] == pytest.approx(got["logprobs"][i], abs=1e-6)
            assert top.ids == ref[n - 1 + i].topk(3).indices.tolist()
            assert top.logprobs == pytest.approx(ref[n - 1 + i].topk(3).values.tolist(), abs=1e-4)
        # prompt: tokens max(1, start) .. n - 1
        pos = range(max(1, start), n)
        assert got["input_logprobs"] == pytest.approx([ref[q - 1, p[q]].item() for q in pos], abs=1e-4)
        assert [t.ids for t in got["input_top"]] == [ref[q - 1].topk(3).indices.tolist() for q in pos]
        torch.testing.assert_close(torch.tensor([t.logprobs for t in got["input_top"]]),
                                   torch.stack([ref[q - 1].topk(3).values for q in pos]), atol=1e-4, rtol=0)


def test_logprobs_stay_aligned_when_a_request_is_aborted(engine):
    got = collect(engine, [lp_req("x", prompt(61, 30), -1, max_new_tokens=40, top_logprobs=0)], abort_after=4)
    assert got["x"]["reason"] == "abort" and 0 < len(got["x"]["tokens"]) < 40
    assert len(got["x"]["logprobs"]) == len(got["x"]["tokens"]) and got["x"]["top"] == []


def test_bias_and_penalties_apply_through_the_engine(engine):
    p = prompt(62, 40)

    def run(rid: str, **sp) -> list[int]:
        r = lp_req(rid, p, -1, max_new_tokens=12, logprobs=False, top_logprobs=0, **sp)
        return collect(engine, [r])[rid]["tokens"]

    plain = run("p")
    banned = run("q", logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0] and plain[0] not in banned
    # a bias makes the model repeat one token (a prompt token) ...
    t = p[0]
    assert run("b", logit_bias={t: 30.0}) == [t] * 12
    # ... a presence penalty lets it occur once; a repetition penalty (applied after the bias) not at all
    once = run("c", logit_bias={t: 30.0}, presence_penalty=100.0)
    assert once[0] == t and once.count(t) == 1
    assert t not in run("d", logit_bias={t: 30.0}, repetition_penalty=100.0)


def test_bench_sampler_runs_both_sides():
    from radixflow.services.bench.sampler import CASES, EXTRAS, run_sampler
    out = run_sampler(batch=4, vocab=512, repeats=1)
    assert set(out["cases"]) == set(CASES) and set(out["extras"]) == set(EXTRAS)
    assert all(c["batched_ms"] > 0 and c["per_row_ms"] > 0 for c in out["cases"].values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax_with_ties_inf_and_nan(dtype):
    """sampler.argmax (max(dim), faster on a CPU) picks what torch.argmax picks: the first of equal
    maxima, a row of -inf's first index, a NaN over any number."""
    g = torch.Generator().manual_seed(0)
    for V in (3, 100, 8192):
        x = torch.randint(0, 3, (32, V), generator=g).to(dtype)
        x[5] = float("-inf")
        x[6, V // 2] = float("nan")
        assert torch.equal(sampler.argmax(x), x.argmax(dim=-1))
