"""The two grammar engines behind one interface (services/grammar/backends): both masks only allow
output that satisfies the constraint, a batch mixing them is masked row by row in one step, the
`auto` choice, and cache keys per engine."""
from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import time

import llguidance as llg
import pytest
import torch
from jsonschema import Draft202012Validator

from radixflow.services.executor.constrain import Constrainer
from radixflow.services.grammar.backends import make, make_all
from radixflow.services.grammar.backends.base import CHECKED, FULL
from radixflow.services.grammar.compiler import AUTO_MAX_SCHEMA_BYTES, Compiler
from radixflow.services.grammar.cost import AUTO_MAX_PREDICTED_S, xgrammar_compile_s
from radixflow.services.grammar.keys import LLGUIDANCE_JSON_OPTIONS, canonicalize, grammar_key
from radixflow.services.tokenizer.tokenizer import Tokenizer
from radixflow.shared.errors import BadRequest
from . import stacks
from .structured.walk import bool_mask

S = {"type": "string", "maxLength": 12}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# enforced in full by both engines: every finished walk must validate
SCHEMAS = {
    "person": PERSON,
    "enum_array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                             "minItems": 1, "maxItems": 3}},
                   "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"p": PERSON, "ok": {"type": "boolean"},
                                                "n": {"type": ["integer", "null"], "minimum": -5, "maximum": 5}},
               "required": ["p", "ok", "n"], "additionalProperties": False},
    "anyof": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, S]},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"], "additionalProperties": False},
}


def large_schema(n: int = 120, cyclic: bool = False) -> dict:
    """The acceptance check's "large" schema (generated-API style: many definitions); cyclic: every
    definition refers to the next, so all of them are reachable (xgrammar's blob then explodes)."""
    defs = {}
    for i in range(n):
        props = {f"f{j}": ({"$ref": f"#/definitions/D{(i + j + 1) % n}"} if j == 0 and (cyclic or i % 10 == 0) else
                           [S, {"type": "integer"}, {"type": "boolean"}, {"enum": [f"v{k}" for k in range(8)]},
                            {"type": "array", "items": S, "maxItems": 2}][j % 5]) for j in range(12)}
        defs[f"D{i}"] = {"type": "object", "properties": props, "additionalProperties": False}
    return {"$ref": "#/definitions/D0", "definitions": defs}


@pytest.fixture(scope="module")
def engines(models):
    ready, failed = make_all(models["tiny-hybrid"])
    assert not failed, failed
    return ready


@pytest.fixture(scope="module")
def tok(models):
    return Tokenizer(models["tiny-hybrid"])


class Walk:
    """Model-free generation through the executor's interface (Backend.fill, Matcher): random
    allowed tokens, biased toward closing structures so that walks end."""

    def __init__(self, tok: Tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tok, vocab_size
        self.bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
        self.stop = torch.zeros(vocab_size, dtype=torch.bool)
        self.stop[sorted(tok.eos_token_ids)] = True
        texts = [tok.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
        self.closer = torch.tensor([any(c in t for c in '"]}') for t in texts])
        self.special = sorted(tok.special_ids - tok.eos_token_ids)

    def allowed(self, matcher) -> torch.Tensor:
        matcher.backend.fill([matcher], self.bitmask, [0])
        return bool_mask(self.bitmask, self.vocab_size)

    def run(self, grammar, rng: random.Random, max_tokens: int = 300) -> tuple[list[int], bool]:
        m = grammar.matcher()
        out: list[int] = []
        for _ in range(max_tokens):
            ok = self.allowed(m)
            assert not ok[self.special].any(), "a special (chat-control) token was allowed"
            stops = (ok & self.stop).nonzero().flatten().tolist()
            if stops and (rng.random() < 0.5 or not (ok & ~self.stop).any()):
                t = rng.choice(stops)
            else:
                pool = ok & ~self.stop
                if rng.random() < 0.3 and (pool & self.closer).any():
                    pool &= self.closer
                ids = pool.nonzero().flatten()
                t = int(ids[rng.randrange(len(ids))])
            assert m.accept_token(t), t
            if self.stop[t]:
                assert m.is_terminated()
                return out, True
            assert not m.is_terminated()
            out.append(t)
        return out, False


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("engine", ["xgrammar", "llguidance"])
def test_walks_through_either_mask_validate(engines, tok, name, engine):
    schema = SCHEMAS[name]
    b = engines[engine]
    compiled = b.compile("json_schema", canonicalize("json_schema", json.dumps(schema)).text)
    assert compiled.enforcement == FULL
    grammar = b.load(compiled.raw)
    walk, rng, finished = Walk(tok, b_vocab(b)), random.Random(7), 0
    for _ in range(12):
        ids, done = walk.run(grammar, rng)
        if not done:
            continue
        finished += 1
        text = tok.decode(ids)
        errors = list(Draft202012Validator(schema).iter_errors(json.loads(text)))
        assert not errors, (engine, text, errors[0].message)
    assert finished >= 6, finished


def b_vocab(b) -> int:
    return b.info.vocab_size if b.name == "xgrammar" else b.tokenizer.vocab_size


def test_other_kinds_on_llguidance(engines, tok):
    b, rng = engines["llguidance"], random.Random(3)
    walk = Walk(tok, b_vocab(b))
    for kind, spec, ok in [("regex", r"[a-z]{2,5}@(x|y)\.com", lambda s: re.fullmatch(r"[a-z]{2,5}@(x|y)\.com", s)),
                           ("choice", '["yes","no","maybe"]', lambda s: s in ("yes", "no", "maybe")),
                           ("ebnf", 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"', lambda s: re.fullmatch(r"\(\d+(,\d+)*\)", s)),
                           ("json_object", "", lambda s: isinstance(json.loads(s), dict))]:
        g = b.load(b.compile(kind, canonicalize(kind, spec).text).raw)
        for _ in range(5):
            ids, done = walk.run(g, rng, max_tokens=200)
            if done:
                assert ok(tok.decode(ids)), (kind, tok.decode(ids))


def test_llguidance_reports_what_it_ignores(engines):
    b = engines["llguidance"]
    for schema in ({"type": "array", "items": S, "uniqueItems": True},
                   {"type": "integer", "not": {"const": 3}},
                   {"oneOf": [S, {"type": "string", "maxLength": 3}]},
                   {"type": "string", "format": "date"}):
        assert b.compile("json_schema", json.dumps(schema)).enforcement == CHECKED, schema
    # what JSON Schema and llguidance both define is enforced
    assert b.compile("json_schema", json.dumps({"type": "number", "multipleOf": 0.5})).enforcement == FULL
    with pytest.raises(ValueError, match="regex"):
        b.compile("json_schema", json.dumps({"type": "string", "pattern": "^(?=a)b$"}))


def test_mixed_batch_masks_each_row_by_its_engine(engines, tok):
    x, ll = engines["xgrammar"], engines["llguidance"]
    V = b_vocab(x)
    mx = x.load(x.compile("regex", "[0-9]+").raw).matcher()
    ml = ll.load(ll.compile("json_schema", json.dumps(PERSON)).raw).matcher()
    ml.accept_token(tok.encode("{")[0])            # one token in: the llguidance row is mid-grammar
    logits = torch.randn(3, V)
    before = logits.clone()
    Constrainer(V, max_rows=2).mask(logits, [mx, ml, None], [0, 0, 0])   # grows its buffer to 3 rows
    walk = Walk(tok, V)
    for row, m in ((0, mx), (1, ml)):
        allowed = walk.allowed(m)
        assert 0 < allowed.sum() < V // 2
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert torch.isinf(logits[row][~allowed]).all()
    assert torch.equal(logits[2], before[2])
    digits = {i for i in range(V) if tok.decode([i]).isdigit()}
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) <= digits
    assert not (torch.isfinite(logits[0]) & torch.isfinite(logits[1])).all()


def test_padded_vocabulary_never_allowed(models, tmp_path):
    """A model whose embedding has more rows than the tokenizer has ids (padding): both masks are
    as wide as the logits and never allow a padding id."""
    d = tmp_path / "padded"
    shutil.copytree(models["tiny-hybrid"], d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    tok_size = cfg["vocab_size"]
    cfg["vocab_size"] = tok_size + 40
    (d / "config.json").write_text(json.dumps(cfg))
    ready, failed = make_all(d)
    assert not failed
    V = tok_size + 40
    c = Constrainer(V, max_rows=2)
    ms = [b.load(b.compile("json_object", "json_object").raw).matcher() for b in ready.values()]
    logits = torch.zeros(2, V)
    c.mask(logits, ms, [0] * len(ms))
    assert c.bitmask.shape[1] == (V + 31) // 32
    assert torch.isinf(logits[:, tok_size:]).all() and torch.isfinite(logits[:, :tok_size]).any(dim=1).all()


# ---------------------------------------------------------------- the compiler's choice and keys


@pytest.fixture(scope="module")
async def compiler(models):
    c = Compiler(models["tiny-hybrid"], deadline_s=20.0, backend="auto")
    await c.start()
    yield c
    await c.stop()


async def test_auto_picks_xgrammar_for_what_it_enforces(compiler):
    r = await compiler.compile("json_schema", json.dumps(PERSON))
    assert (r.backend, r.enforcement) == ("xgrammar", FULL)
    again = await compiler.compile("json_schema", json.dumps(PERSON, indent=2))
    assert again.cache_hit and again.key == r.key and again.backend == "xgrammar"
    for kind, spec in (("regex", "[a-z]{3}"), ("choice", '["a","b"]'), ("json_object", "")):
        assert (await compiler.compile(kind, spec)).backend == "xgrammar"


async def test_auto_picks_llguidance_where_xgrammar_falls_short(compiler):
    # enforced in full by llguidance, only checked after the fact with xgrammar
    step = {"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.5}}, "required": ["p"]}
    r = await compiler.compile("json_schema", json.dumps(step))
    assert (r.backend, r.enforcement) == ("llguidance", FULL)
    # a large generated schema: llguidance without trying xgrammar
    large = json.dumps(large_schema())
    assert len(large) > AUTO_MAX_SCHEMA_BYTES
    t0 = time.perf_counter()
    r = await compiler.compile("json_schema", large)
    assert r.backend == "llguidance" and time.perf_counter() - t0 < 5
    # small but cyclic: xgrammar's grammar is over the auto budget, refused before compiling it
    cyclic = json.dumps(large_schema(12, cyclic=True))
    assert len(cyclic) < AUTO_MAX_SCHEMA_BYTES
    timeouts = compiler.timeouts
    r = await compiler.compile("json_schema", cyclic)
    assert r.backend == "llguidance" and compiler.timeouts == timeouts
    hit = await compiler.compile("json_schema", cyclic)
    assert hit.cache_hit and hit.backend == "llguidance"
    # what neither engine enforces in full stays with xgrammar (its normalization enforces more)
    unique = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    r = await compiler.compile("json_schema", json.dumps(unique))
    assert (r.backend, r.enforcement) == ("xgrammar", CHECKED)


async def test_auto_keeps_the_lints_refusals(compiler):
    """What lint.prepare refuses outright (invalid, unsatisfiable) stays a 400 under auto, though
    llguidance would compile it; what the lint only cannot rewrite for xgrammar (merge.Unsupported)
    goes to llguidance, checked."""
    dynamic = {"$dynamicAnchor": "node", "type": "object", "properties": {"c": {"$dynamicRef": "#node"}}}
    with pytest.raises(BadRequest, match="'\\$dynamicRef'"):
        await compiler.compile("json_schema", json.dumps(dynamic), backend="xgrammar")
    r = await compiler.compile("json_schema", json.dumps(dynamic))
    assert (r.backend, r.enforcement) == ("llguidance", CHECKED)
    with pytest.raises(BadRequest, match="invalid JSON Schema"):
        await compiler.compile("json_schema", json.dumps({"type": "string", "minLength": -1}))
    never = {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}},
             "required": ["a"]}
    with pytest.raises(BadRequest, match="the JSON Schema is unsatisfiable"):      # the lint's reason
        await compiler.compile("json_schema", json.dumps(never))


async def test_llguidance_compiles_what_it_refused_widened(compiler):
    """Patterns llguidance cannot read (lookarounds, \\A \\Z) and patternProperties it cannot prove
    disjoint: it compiles the schema widened there (lint.widen_for_llguidance), checked, where it
    refused the schema as sent."""
    parts = {"name": {"type": "string", "pattern": "^(?!aws:)[a-z]+$", "maxLength": 8},
             "line": {"type": "string", "pattern": "\\A[^\\n]*\\Z"},
             "tags": {"type": "object", "patternProperties": {"^": {"type": "string"}, "^x-": {"type": "string"}}}}
    for name, sub in parts.items():
        schema = {"type": "object", "properties": {name: sub}, "required": [name]}
        text = json.dumps(schema)
        grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=LLGUIDANCE_JSON_OPTIONS)
        assert llg.LLMatcher.validate_grammar_with_warnings(grammar)[0], name     # refused as sent
        r = await compiler.compile("json_schema", text, backend="llguidance")
        assert (r.backend, r.enforcement) == ("llguidance", CHECKED), name


def test_cost_model_grows_with_the_grammar_its_regexes_and_the_vocabulary():
    plain, patterned = "root ::= " + "x" * 5000, "root ::= " + 'Regex("a+") ' * 8
    assert xgrammar_compile_s(plain, 8192) < AUTO_MAX_PREDICTED_S
    assert xgrammar_compile_s(plain, 248320) > xgrammar_compile_s(plain, 8192)
    assert xgrammar_compile_s(patterned, 8192) > AUTO_MAX_PREDICTED_S > xgrammar_compile_s(patterned[:40], 8192)


async def test_auto_skips_xgrammar_when_the_cost_model_expects_it_slow(compiler):
    """Many patterns: the worker refuses auto's xgrammar try before compiling (no budget waited
    for), so auto answers with llguidance at once; explicitly, xgrammar compiles it in full."""
    props = {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i + 1}}}$"} for i in range(8)}
    schema = json.dumps({"type": "object", "properties": props, "required": list(props),
                         "additionalProperties": False})
    t0 = time.perf_counter()
    r = await compiler.compile("json_schema", schema)
    assert r.backend == "llguidance" and time.perf_counter() - t0 < compiler.auto_budget_s
    assert (await compiler.compile("json_schema", schema, backend="xgrammar")).enforcement == FULL


async def test_auto_budget_falls_back_without_killing(models):
    """A request whose xgrammar job outruns the auto budget gets llguidance at once; the job is not
    killed at the budget (under load that would kill compiles that are only slow for lack of CPU)
    but at the deadline, and until then auto's next requests do not wait on it again."""
    c = Compiler(models["tiny-hybrid"], deadline_s=4.0, backend="auto", auto_budget_s=0.3)
    await c.start()
    try:
        hostile = json.dumps({"type": "string", "pattern": "^[a-z0-9]{1,20000}$"})   # ~25 s for xgrammar
        t0 = time.perf_counter()
        r = await c.compile("json_schema", hostile)
        assert r.backend == "llguidance" and time.perf_counter() - t0 < 3
        assert r.compile_s >= c.auto_budget_s      # what auto cost: the xgrammar try's budget included
        assert c.timeouts == 0 and c.workers_alive == 2
        t1 = time.perf_counter()
        again = await c.compile("json_schema", hostile)
        assert again.cache_hit and again.backend == "llguidance" and time.perf_counter() - t1 < 0.1
        for _ in range(100):                     # the xgrammar job meets its deadline
            if c.timeouts:
                break
            await asyncio.sleep(0.1)
        assert c.timeouts == 1
        assert (await c.compile("json_schema", hostile)).backend == "llguidance"
        assert (await c.compile("regex", "[0-9]{2}", backend="xgrammar")).backend == "xgrammar"
    finally:
        await c.stop()


async def test_cache_keys_differ_by_engine(compiler):
    spec = json.dumps(dict(PERSON, title="both"))
    rx = await compiler.compile("json_schema", spec, backend="xgrammar")
    rl = await compiler.compile("json_schema", spec, backend="llguidance")
    assert rx.key != rl.key and (rx.backend, rl.backend) == ("xgrammar", "llguidance")
    canon = canonicalize("json_schema", spec)
    assert rx.key == grammar_key(canon, compiler.identity, "xgrammar")
    assert rl.key == grammar_key(canon, compiler.identity, "llguidance")
    assert compiler.fetch(rx.key).backend == "xgrammar" and compiler.fetch(rl.key).backend == "llguidance"
    assert rl.size < rx.size    # llguidance's blob is the grammar text
    with pytest.raises(BadRequest, match="unknown grammar backend"):
        await compiler.compile("json_schema", spec, backend="outlines")
    with pytest.raises(BadRequest, match="invalid JSON Schema"):
        await compiler.compile("json_schema", json.dumps({"minLength": -1}), backend="llguidance")


# ---------------------------------------------------------------- end to end


async def test_stack_serves_both_engines_in_one_batch(models):
    """Through HTTP: requests whose grammars auto gives to different engines run together; every
    output parses and validates, and the unconstrained one is unaffected."""
    st = await stacks.start(models["tiny-hybrid"], ex_max_running_requests=16)
    try:
        async def post(body):
            async with st.http.post(st.base + "/generate", json=body) as r:
                return r.status, await r.json()

        step = {"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.5, "minimum": 0,
                                                       "maximum": 9}}, "required": ["p"], "additionalProperties": False}
        schemas = [PERSON, step, large_schema(), PERSON, step]
        free = {"text": "free", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
        _, alone = await post(free)
        res = await asyncio.gather(post(free), *(post({"text": "json:", "sampling_params": {
            "json_schema": json.dumps(s), "max_new_tokens": 400, "temperature": 0.8, "seed": i}})
            for i, s in enumerate(schemas)))
        assert res[0][1]["output_ids"] == alone["output_ids"]
        used = set()
        for s, (status, body) in zip(schemas, res[1:]):
            assert status == 200, body
            used.add(body["meta_info"]["grammar"]["backend"])
            assert not list(Draft202012Validator(s).iter_errors(json.loads(body["text"]))), body["text"]
        assert used == {"xgrammar", "llguidance"}
    finally:
        await stacks.stop(st)



@pytest.mark.parametrize("V", [4096, 1000, 33])
@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_bitmask_apply_equals_xgrammars_kernel(V, form, monkeypatch):
    """The CPU bitmask paths (kernels/bitmask: the C++ kernel, and its torch form, which serves
    where that is not built; both faster than xgrammar's) against xgrammar's own kernel: words all
    clear, all set and mixed, a vocabulary that is not a multiple of 32, and only some rows masked."""
    import xgrammar as xgr
    from radixflow.kernels import cpu_ext
    from radixflow.kernels.bitmask import cpu as bitmask_cpu
    from radixflow.kernels.bitmask import reference as bitmask_ref
    assert cpu_ext.wait(600) is not None, "the CPU kernels did not build"
    apply_bitmask = bitmask_cpu.apply_bitmask if form == "kernel" else bitmask_ref.apply_bitmask
    if form == "kernel":      # never the torch form
        monkeypatch.setattr(bitmask_ref, "apply_bitmask", lambda *a: pytest.fail("went to the torch form"))
    g = torch.Generator().manual_seed(V)
    W = (V + 31) // 32
    bm = torch.randint(-2**31, 2**31 - 1, (6, W), dtype=torch.int32, generator=g)
    bm[0] = 0
    bm[1] = -1
    bm[2, : W // 2] = 0
    bm[3, ::3] = -1
    logits = torch.randn(6, V, generator=g)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 3, 4], [2]):
        want, got = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(want, bm, indices=rows, vocab_size=V)
        apply_bitmask(got, bm, rows)
        assert torch.equal(got, want), rows


def test_device_bitmask_path_masks_the_rows_asked():
    """The accelerator path (bitmask rows sent to the device, xgrammar's kernel there) masks logits
    row rows[j] with bitmask row mask_rows[j] and leaves the other rows alone, as the CPU path
    does. On a CPU it runs with xgrammar's torch backend; on CUDA its kernel is xgrammar's own."""
    from radixflow.kernels.bitmask.reference import apply_bitmask
    from radixflow.services.executor.constrain import apply_bitmask_device
    V = 1000
    g = torch.Generator().manual_seed(1)
    bm = torch.randint(-2**31, 2**31 - 1, (8, (V + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(5, V, generator=g)
    for rows, mask_rows in (([0, 1, 2, 3, 4], None), ([1, 4], [6, 2]), ([3], [0])):
        want, got = logits.clone(), logits.clone()
        apply_bitmask(want, bm, rows, mask_rows)
        apply_bitmask_device(got, bm, rows, mask_rows, backend="torch_native")
        assert torch.equal(got, want), rows


async def test_schema_past_llguidances_node_limit_is_served_normalized(compiler):
    """llguidance expands a schema into at most 50,000 nodes ("schema too large"); a CI config's
    tasks (an anyOf of hundreds of tasks, each naming itself by a pattern that the common `task`
    property's anyOf of names must meet) pass it, and xgrammar's compile of the same is over the
    deadline. Normalized, the same schema fits llguidance: served, not refused."""
    names = [f"Tool{i}@{v}" for i in range(130) for v in (1, 2)]
    task = {"type": "object", "additionalProperties": False,
            "properties": {"task": {"anyOf": [{"enum": [n], "description": f"the {n} task"} for n in names]},
                           "inputs": {"type": "object"}},
            "anyOf": [{"properties": {"task": {"pattern": f"^{n}$"}}, "required": ["task"]} for n in names]}
    schema = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "$ref": "#/$defs/task"},
                                                         "maxItems": 2}},
              "required": ["steps"], "$defs": {"task": task}}
    text = json.dumps(schema)
    assert len(text) > AUTO_MAX_SCHEMA_BYTES
    with pytest.raises(ValueError, match="schema too large"):                 # as sent
        make("llguidance", compiler.model_dir).compile("json_schema", text)
    r = await compiler.compile("json_schema", text)
    assert r.backend == "llguidance"
