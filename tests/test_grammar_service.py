"""The grammar service over NATS: compile and fetch, the cache behind them, deadlines, errors, metrics,
and another instance serving a key by compiling its source."""
from __future__ import annotations

import asyncio
import importlib.metadata
import re
import statistics
import time
import zlib

import pytest
import xgrammar as xgr

from radixflow.services.grammar.service import GrammarService
from radixflow.services.grammar.tokenizer_info import make_tokenizer_info
from radixflow.services.tokenizer.tokenizer import Tokenizer
from radixflow.shared import subjects
from radixflow.shared.bus import Bus
from radixflow.shared.config import BusConfig
from radixflow.shared.errors import BadRequest, NotFound
from radixflow.shared.messages import (GrammarBlob, GrammarCompile, GrammarCompiled, GrammarFetch, MetricsReply,
                                       StatusRequest)
from .structured.corpus import ACCEPTED, NOW_SERVED, PERSON, REJECTED, SERVED_NOW, STILL_REJECTED, dumps

DEADLINE_S = 1.5
# ~25 s for xgrammar on this machine (quadratic in the repetition bound); killed at the deadline
HOSTILE = {"type": "string", "pattern": "^[a-z0-9]{1,20000}$"}




@pytest.fixture(scope="module")
def info(models):
    return make_tokenizer_info(models["tiny-hybrid"])


# ---------------------------------------------------------------- the service over NATS


@pytest.fixture(scope="module")
async def grammar(nats_server, models):
    sbus = Bus("grammar-svc", BusConfig(nats_url=nats_server.url))
    await sbus.connect()
    svc = GrammarService(sbus, models["tiny-hybrid"], deadline_s=DEADLINE_S, backend="xgrammar")   # its tests are of xgrammar
    await svc.start()
    client = Bus("grammar-client", BusConfig(nats_url=nats_server.url, request_timeout_s=30))
    await client.connect()
    yield svc, client
    await client.close()
    await svc.drain(2)
    await svc.stop()
    await sbus.close()


async def compile_(client: Bus, kind: str, spec: str, tokenizer: str = "") -> GrammarCompiled:
    return await client.request(subjects.GRAMMAR_COMPILE, GrammarCompile(kind=kind, spec=spec, tokenizer=tokenizer),
                                GrammarCompiled)


async def test_whitespace_variant_is_a_cache_hit(grammar):
    svc, client = grammar
    schema = dict(PERSON, title="hit-test")
    first = await compile_(client, "json_schema", dumps(schema))
    second = await compile_(client, "json_schema", dumps(schema, indent=2, separators=(" ,", " : ")))
    assert not first.cache_hit and first.compile_s > 0 and first.size > 0
    assert second.cache_hit and second.key == first.key and second.compile_s == 0
    # the handler's own time on a hit (no bus): well under a millisecond
    req = GrammarCompile(kind="json_schema", spec=dumps(schema, indent=1))
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        r = await svc.compile(req)
        times.append(time.perf_counter() - t0)
    assert r.cache_hit
    assert statistics.median(times) < 1e-3, statistics.median(times)


async def test_concurrent_requests_compile_once(grammar):
    svc, client = grammar
    schema = {"type": "string", "pattern": "^[a-z]{1,1200}$", "title": "single-flight"}   # ~0.1 s to compile
    before = svc.compiler.compiles
    out = await asyncio.gather(*(compile_(client, "json_schema", dumps(schema)) for _ in range(20)))
    assert svc.compiler.compiles - before == 1
    assert len({o.key for o in out}) == 1


@pytest.mark.parametrize("kind,spec,needle", [
    ("json_schema", dumps({"type": "object", "properties": {"a": {"type": "strin"}}}), "'strin' is not valid"),
    ("json_schema", dumps({"type": "string", "pattern": "^a\\b"}), "Word boundary is not supported"),
    ("json_schema", dumps({"type": "string", "pattern": "^(a)\\1$"}), "Backreference is not supported"),
    ("json_schema", dumps({"type": "array", "items": {"$ref": "other.json#/x"}}), "'$ref'"),
    ("regex", "a(b", "The parenthesis is not closed"),
    ("regex", "[z-a]", "regex does not compile"),
    ("ebnf", 'root ::= "a" |', "EBNF parser error"),
    ("ebnf", 'root ::= missing_rule', "does not compile"),
])
async def test_invalid_specs_are_400_with_the_reason(grammar, kind, spec, needle):
    _, client = grammar
    with pytest.raises(BadRequest) as ei:
        await compile_(client, kind, spec)
    assert needle in ei.value.message and ei.value.code == 400


async def test_unenforceable_warning_is_checked_or_400(grammar):
    """What xgrammar warns it will not enforce (and lint did not foresee): a JSON schema's output is
    validated against the schema (checked); a regex, which nothing validates, is refused."""
    _, client = grammar
    r = await compile_(client, "json_schema", dumps({"type": "string", "pattern": "^(^a$)|(^b$)$"}))
    assert r.enforcement == "checked"
    with pytest.raises(BadRequest, match="the regex cannot be enforced exactly"):
        await compile_(client, "regex", "ab$c")


async def test_blob_over_the_limit_is_400(grammar):
    svc, client = grammar
    limit = svc.compiler.max_blob_bytes
    assert 0 < limit <= client.max_payload
    svc.compiler.max_blob_bytes = 1000
    try:
        with pytest.raises(BadRequest, match="MiB compressed, over the"):
            await compile_(client, "json_schema", dumps(dict(PERSON, title="too-big")))
    finally:
        svc.compiler.max_blob_bytes = limit


async def test_tokenizer_mismatch_is_400(grammar):
    svc, client = grammar
    with pytest.raises(BadRequest, match="compiles for tokenizer"):
        await compile_(client, "json_object", "", tokenizer="someone-else")
    ok = await compile_(client, "json_object", "", tokenizer=svc.compiler.identity)
    assert ok.key


async def test_hostile_schema_hits_deadline_while_others_flow(grammar):
    svc, client = grammar
    t0 = time.perf_counter()

    async def simple() -> float:
        await asyncio.sleep(0.2)   # let the hostile compile take its worker first
        await compile_(client, "json_schema", dumps(dict(PERSON, title="while-stuck")))
        return time.perf_counter() - t0

    hostile, quick = await asyncio.gather(compile_(client, "json_schema", dumps(HOSTILE)), simple(),
                                          return_exceptions=True)
    assert isinstance(hostile, BadRequest), hostile
    assert f"took longer than {DEADLINE_S:g}s; simplify it" in hostile.message
    assert time.perf_counter() - t0 < DEADLINE_S + 3
    assert quick < DEADLINE_S, quick
    assert svc.compiler.timeouts >= 1
    # sent again: refused at once, without tying up a worker for another deadline
    t1 = time.perf_counter()
    with pytest.raises(BadRequest, match="took longer than"):
        await compile_(client, "json_schema", dumps(HOSTILE, indent=1))
    assert time.perf_counter() - t1 < 0.5 and svc.compiler.timeouts == 1
    # the killed worker is replaced; compiling keeps working
    for _ in range(100):
        if svc.compiler.workers_alive == 2:
            break
        await asyncio.sleep(0.1)
    assert svc.compiler.workers_alive == 2
    assert (await compile_(client, "regex", "[0-9]{3}")).key


async def test_fetch_blob_deserializes_and_matches(grammar, models, info):
    _, client = grammar
    done = await compile_(client, "json_schema", dumps(PERSON))
    blob = await client.request(subjects.GRAMMAR_FETCH, GrammarFetch(key=done.key), GrammarBlob)
    text = zlib.decompress(blob.data).decode()
    assert len(text) == done.size
    g = xgr.CompiledGrammar.deserialize_json(text, make_tokenizer_info(models["tiny-hybrid"]))
    m = xgr.GrammarMatcher(g)
    tok = Tokenizer(models["tiny-hybrid"])
    for t in tok.encode('{"name": "Ann Lee", "age": 41}'):
        assert m.accept_token(t), t
    assert m.accept_token(2) and m.is_terminated()
    bad = xgr.GrammarMatcher(g)
    assert not all(bad.accept_token(t) for t in tok.encode('{"name": "Ann", "age": 151}'))


async def test_fetch_unknown_key_is_404(grammar):
    _, client = grammar
    with pytest.raises(NotFound, match="no compiled grammar"):
        await client.request(subjects.GRAMMAR_FETCH, GrammarFetch(key="0" * 64), GrammarBlob)


async def test_every_kind_and_the_corpus_compile(grammar):
    _, client = grammar
    for kind, spec in [("json_object", ""), ("regex", r"\d{3}-\d{4}"), ("choice", '["yes", "no", "it \\"depends\\""]'),
                       ("ebnf", 'root ::= "a" [0-9]+')]:
        assert (await compile_(client, kind, spec)).size > 0
    for name, schema in ACCEPTED:
        assert (await compile_(client, "json_schema", dumps(schema))).key, name
    for name, schema, construct in REJECTED + SERVED_NOW:
        if name in NOW_SERVED:
            assert (await compile_(client, "json_schema", dumps(schema))).key, name
            continue
        with pytest.raises(BadRequest, match=re.escape(f"'{STILL_REJECTED[name]}'")):
            await compile_(client, "json_schema", dumps(schema))


async def test_metrics_and_status(grammar):
    svc, client = grammar
    hits, compiles = svc.compiler.cache.hits, svc.compiler.compiles
    await compile_(client, "regex", "[a-c]{2}x")      # a spec no other test compiles: a miss, then a hit
    await compile_(client, "regex", "[a-c]{2}x")
    assert (svc.compiler.cache.hits - hits, svc.compiler.compiles - compiles) == (1, 1)
    replies = await client.gather(subjects.METRICS, StatusRequest(), MetricsReply, window_s=0.5)
    mine = [r for r in replies if r.instance == svc.instance]
    assert mine
    by = {}
    for s in mine[0].samples:
        by.setdefault(s.name, []).append(s)
    for name in ("grammar_cache_hits_total", "grammar_compiles_total", "grammar_cache_bytes",
                 "grammar_compile_seconds_sum", "grammar_compile_seconds_count"):
        assert name in by, name
    assert by["grammar_cache_hits_total"][0].value == svc.compiler.cache.hits and by["grammar_cache_bytes"][0].value > 0
    assert by["grammar_compiles_total"][0].value == svc.compiler.compiles
    buckets = by["grammar_compile_seconds_bucket"]
    assert [b.labels["le"] for b in buckets] == ["0.01", "0.05", "0.1", "0.5", "1", "5", "10", "+Inf"]
    counts = [b.value for b in buckets]
    assert counts == sorted(counts) and counts[-1] == by["grammar_compile_seconds_count"][0].value
    st = svc.status()
    assert st["xgrammar"] == importlib.metadata.version("xgrammar")
    assert st["llguidance"] == importlib.metadata.version("llguidance")
    assert st["entries"] >= 1 and "hits" in st and "evictions" in st


async def test_another_instance_serves_a_key_by_compiling_its_source(grammar, models):
    """Several grammar instances (or one restarted) share compiled grammars: a fetch carries the
    source of its key, and an instance that does not hold the key compiles it and serves it."""
    svc, client = grammar
    schema = dumps(dict(PERSON, title="elsewhere"))
    compiled = await compile_(client, "json_schema", schema)
    bus2 = Bus("grammar-svc-2", BusConfig(nats_url=client.config.nats_url))
    await bus2.connect()
    other = GrammarService(bus2, models["tiny-hybrid"], deadline_s=DEADLINE_S, backend="xgrammar")
    await other.compiler.start(wait_workers=True)       # its handlers called directly: no subscription
    try:
        with pytest.raises(NotFound):
            await other.fetch(GrammarFetch(key=compiled.key))
        blob = await other.fetch(GrammarFetch(key=compiled.key, source=GrammarCompile(
            kind="json_schema", spec=schema, backend=compiled.backend)))
        mine = await svc.fetch(GrammarFetch(key=compiled.key))
        assert blob.key == compiled.key and blob.backend == mine.backend == compiled.backend
        assert zlib.decompress(blob.data) == zlib.decompress(mine.data)
        with pytest.raises(NotFound, match="another key"):          # a source that does not make the key
            await other.fetch(GrammarFetch(key=compiled.key[::-1], source=GrammarCompile(
                kind="json_schema", spec=schema, backend=compiled.backend)))
    finally:
        await other.compiler.stop()
        await bus2.close()
