"""Bad input everywhere (issue 13): every HTTP route and every public NATS subject gets a corpus of
hostile input. Each gets a clear 4xx (HTTP) or a typed ErrorReply with a 4xx code (NATS), within
seconds; afterwards no service has crashed or restarted a loop, no page or state slot is held,
and a normal request is served."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import jsonschema
import msgspec
import nats
import pytest

from radixflow.shared import subjects

from .stacks import start, stop

JSON_H = {"Content-Type": "application/json"}
DEEP = "[" * 5000 + "]" * 5000
HOSTILE_SCHEMAS = [
    {"$ref": "#"},                                                        # a schema that is only itself
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}},
    {"type": "string", "pattern": "[unclosed"},
    {"type": "integer", "minimum": 10, "maximum": 1},                     # nothing satisfies it
    {"enum": []},
    {"type": "nonsense"},
    {"anyOf": "not a list"},
    {"type": "string", "maxLength": -5},
]
# nested arrays whose fourth level refers back to the third: hostile, yet valid and satisfiable
# ("[[]]" is an answer), so within 4 tokens it is served or refused (max_tokens), never a 5xx. It
# sat among the invalid schemas above, expecting a 4xx, until a sampled "[ [ ] ]" came back 200.
RECURSIVE_ARRAYS = json.loads(json.dumps({"type": "array", "items": {"type": "array", "items": {
    "type": "array", "items": {"type": "array", "items": {"$ref": "#/items/items/items"}}}}}))


def completion(**kw):
    return {"model": "tiny-dense", "prompt": "hello", "max_tokens": 4} | kw


def chat(**kw):
    return {"model": "tiny-dense", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | kw


def generate(**kw):
    return {"text": "hello", "sampling_params": {"max_new_tokens": 4}} | kw


def http_corpus(vocab: int, max_len: int, max_payload: int) -> list[tuple[str, str, bytes | dict | None]]:
    """(method, path, body): raw bytes are sent as they are, dicts as JSON."""
    c: list[tuple[str, str, bytes | dict | None]] = []
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/programs"):
        c += [("POST", path, b"{not json"), ("POST", path, b""), ("POST", path, b"[]"), ("POST", path, b"null"),
              ("POST", path, b"\xff\xfe\x00bad utf-8"), ("POST", path, DEEP.encode()),
              ("POST", path, b'{"a": NaN}')]
    c += [
        # wrong types
        ("POST", "/v1/completions", completion(max_tokens="four")),
        ("POST", "/v1/completions", completion(prompt=12.5)),
        ("POST", "/v1/completions", completion(temperature="hot")),
        ("POST", "/v1/chat/completions", chat(messages="hi")),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "user"}])),
        ("POST", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}])),
        ("POST", "/generate", generate(sampling_params=[1, 2])),
        ("POST", "/generate", {"text": None, "input_ids": None}),
        ("POST", "/tokenize", {"text": 5}),
        ("POST", "/detokenize", {"tokens": "abc"}),
        # huge, negative and absurd numbers
        ("POST", "/v1/completions", completion(max_tokens=10 ** 30)),
        ("POST", "/v1/completions", completion(max_tokens=-1)),
        ("POST", "/v1/completions", completion(max_tokens=max_len * 10)),
        ("POST", "/v1/completions", completion(n=10 ** 6)),
        ("POST", "/v1/completions", completion(n=0)),
        ("POST", "/v1/completions", completion(temperature=-3)),
        ("POST", "/v1/completions", completion(top_p=7)),
        ("POST", "/v1/completions", completion(top_k=-100)),
        ("POST", "/v1/completions", completion(logprobs=10 ** 9)),
        ("POST", "/v1/completions", completion(seed=-(2 ** 70))),
        ("POST", "/v1/completions", completion(presence_penalty=1e308)),
        ("POST", "/v1/chat/completions", chat(top_logprobs=-2, logprobs=True)),
        ("POST", "/v1/chat/completions", chat(max_completion_tokens=-5)),
        ("POST", "/generate", generate(sampling_params={"max_new_tokens": -7})),
        ("POST", "/generate", generate(sampling_params={"temperature": float("inf")})),
        ("POST", "/v1/completions", b'{"model": "tiny-dense", "prompt": "x", "temperature": NaN}'),
        ("POST", "/v1/completions", b'{"model": "tiny-dense", "prompt": "x", "top_p": Infinity}'),
        # empty and oversize prompts, oversize payloads
        ("POST", "/v1/completions", completion(prompt="")),
        ("POST", "/v1/completions", completion(prompt=[])),
        ("POST", "/v1/chat/completions", chat(messages=[])),
        ("POST", "/generate", generate(text="")),
        ("POST", "/generate", {"input_ids": [], "sampling_params": {}}),
        ("POST", "/v1/completions", completion(prompt=[5] * (max_len + 10))),
        ("POST", "/generate", {"input_ids": [7] * (max_len + 1)}),
        ("POST", "/v1/completions", completion(prompt="x" * (max_payload + 1024))),
        ("POST", "/generate", generate(text="word " * (max_payload // 4))),
        # unknown fields (accepted and ignored by OpenAI clients' servers) next to a bad value
        ("POST", "/v1/completions", completion(frobnicate=True, max_tokens=-1)),
        ("POST", "/generate", generate(unknown_knob={"x": 1}, sampling_params={"max_new_tokens": "many"})),
        # control characters and odd strings in names
        # (a model name is not bad input: one served model answers to any name, as documented)
        ("POST", "/v1/completions", completion(user="\x00" * 10 ** 5, max_tokens=-2)),
        ("POST", "/v1/completions", completion(stop=["\x00"] * 100)),
        ("POST", "/v1/completions", completion(stop=["x"] * 10 ** 4)),
        ("POST", "/generate", generate(rid="a" * 10 ** 5)),
        # unknown token ids
        ("POST", "/v1/completions", completion(prompt=[vocab + 5])),
        ("POST", "/v1/completions", completion(prompt=[-1, 3])),
        ("POST", "/generate", {"input_ids": [2 ** 40]}),
        ("POST", "/detokenize", {"tokens": [-5]}),
        ("POST", "/v1/completions", completion(logit_bias={str(vocab + 1): 5})),
        ("POST", "/v1/completions", completion(logit_bias={"abc": 5})),
        # hostile structured output
        *[("POST", "/v1/chat/completions", chat(response_format={"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": s}}))
          for s in HOSTILE_SCHEMAS],
        ("POST", "/v1/chat/completions", chat(response_format={"type": "json_schema"})),
        ("POST", "/v1/chat/completions", chat(response_format={"type": "xml"})),
        ("POST", "/v1/completions", completion(guided_regex="(((")),
        ("POST", "/v1/completions", completion(guided_grammar="root ::= undefined_rule")),
        ("POST", "/v1/completions", completion(guided_choice=[])),
        ("POST", "/v1/completions", completion(guided_json="{not json")),
        ("POST", "/v1/completions", completion(guided_json={"type": "object"}, guided_regex="a")),
        # programs
        ("POST", "/v1/programs", {"nodes": []}),
        ("POST", "/v1/programs", {"nodes": [{"id": "a", "kind": "gen", "parent": "a", "text": "x"}]}),
        ("POST", "/v1/programs", {"nodes": [{"id": "a b c", "kind": "gen", "text": "x"}]}),
        ("POST", "/v1/programs", {"nodes": [{"id": "a", "kind": "teleport", "text": "x"}]}),
        ("POST", "/v1/programs", {"nodes": [{"id": f"n{i}", "kind": "gen", "text": "x"} for i in range(5000)]}),
        ("GET", "/v1/programs/does-not-exist", None),
        ("DELETE", "/v1/programs/does-not-exist", None),
        ("DELETE", "/v1/programs/nope/nodes/also-nope", None),
        ("POST", "/flush_cache", b"{bad"),
        ("POST", "/flush_cache", {"all": "yes please"}),
    ]
    return c


# hostile but valid: served, or refused with a clear 4xx (compile deadline), never a 5xx or a hang
HOSTILE_VALID = [
    ("POST", "/v1/completions", completion(guided_regex="(a|aa)*" * 200)),
    ("POST", "/v1/chat/completions", chat(max_tokens=64, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": "^(a+)+$", "maxLength": 20}}})),
    ("POST", "/v1/completions", completion(guided_regex="[a-z]{1,3000}")),
    ("POST", "/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": RECURSIVE_ARRAYS}})),
]


async def test_hostile_but_valid_input_is_served_or_refused_clearly(server):
    st = server
    for method, path, body in HOSTILE_VALID:
        async with st.http.request(method, st.base + path, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200 or 400 <= r.status < 500, (path, body, r.status, await r.text())
            if r.status == 200 and body.get("response_format", {}).get("type") == "json_schema":
                # served: the answer is the schema's (never a partial "[ [")
                answer = json.loads((await r.json())["choices"][0]["message"]["content"])
                jsonschema.validate(answer, body["response_format"]["json_schema"]["schema"])
    await assert_unharmed(st)


async def test_every_http_route_answers_hostile_input_with_a_clear_4xx(server):
    st = server
    ex = st.actors["executor"]
    vocab, max_len = ex.engine.spec.vocab_size, ex.engine.max_model_len
    corpus = http_corpus(vocab, max_len, st.actors["gateway"].bus.max_payload)
    assert len(corpus) >= 80
    bad = []
    for method, path, body in corpus:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        try:
            async with st.http.request(method, st.base + path, data=data, headers=JSON_H,
                                       timeout=aiohttp.ClientTimeout(total=30)) as r:
                text = await r.text()
                ok = 400 <= r.status < 500
                if ok and r.content_type == "application/json":
                    err = json.loads(text).get("error", {})
                    ok = bool(err.get("message")) and err.get("code") == r.status
                if not ok:
                    bad.append(f"{method} {path} {str(body)[:80]!r}: {r.status} {text[:200]}")
        except asyncio.TimeoutError:
            bad.append(f"{method} {path} {str(body)[:80]!r}: no answer in 30 s")
    assert not bad, "\n".join(bad)
    await assert_unharmed(st)


def nats_corpus(vocab: int) -> list[tuple[str, bytes, dict]]:
    """(subject, payload, headers)."""
    js = {"Content-Type": "application/json"}
    mp = msgspec.msgpack.encode
    c: list[tuple[str, bytes, dict]] = []
    subs = [subjects.SCHEDULER_SUBMIT, subjects.SCHEDULER_PROGRAM, subjects.TOKENIZER_ENCODE,
            subjects.TOKENIZER_DETOKENIZE, subjects.GRAMMAR_COMPILE, subjects.GRAMMAR_FETCH, subjects.RADIX_PLACE,
            subjects.RADIX_FLUSH, subjects.RADIX_ADOPT, subjects.radix_step("no-such-pool"), subjects.PROGRAM_GET]
    # (unknown fields are ignored, for services of different versions on one bus: a message of
    # nothing but unknown fields is a valid empty one, so they ride here beside a wrong type)
    for s in subs:
        c += [(s, b"\xc1\xc1 not msgpack", {}), (s, b"{not json", js), (s, mp([1, 2, 3]), {}),
              (s, json.dumps({"rid": 5, "pool": 5, "key": 5, "namespace": 5, "zzz": [DEEP]}).encode(), js)]
    c += [
        (subjects.SCHEDULER_SUBMIT, json.dumps({"rid": "x", "text": "", "sampling": {}}).encode(), js),
        (subjects.SCHEDULER_SUBMIT, json.dumps({"rid": "x", "input_ids": [vocab + 9]}).encode(), js),
        (subjects.SCHEDULER_SUBMIT, json.dumps({"rid": "x", "text": "hi", "sampling": {"max_new_tokens": -3}}).encode(), js),
        (subjects.SCHEDULER_SUBMIT, json.dumps({"rid": "x", "text": "hi", "sampling": {"temperature": "warm"}}).encode(), js),
        (subjects.TOKENIZER_DETOKENIZE, json.dumps({"items": [{"ids": [-4], "prefix_offset": 0, "read_offset": 0}]}).encode(), js),
        (subjects.GRAMMAR_COMPILE, json.dumps({"kind": "regex", "spec": "((("}).encode(), js),
        (subjects.GRAMMAR_COMPILE, json.dumps({"kind": "telepathy", "spec": "x"}).encode(), js),
        (subjects.GRAMMAR_COMPILE, json.dumps({"kind": "json_schema", "spec": json.dumps({"$ref": "#"})}).encode(), js),
        (subjects.GRAMMAR_FETCH, json.dumps({"key": "no-such-key"}).encode(), js),
        (subjects.RADIX_PLACE, json.dumps({"namespace": "x", "token_ids": "abc", "pools": ["nobody"]}).encode(), js),
        (subjects.RADIX_FLUSH, json.dumps({"pool": 5, "scopes": "all"}).encode(), js),
        (subjects.RADIX_ADOPT, json.dumps({"pool": "nobody", "held": []}).encode(), js),
    ]
    return c


async def test_every_public_nats_subject_answers_hostile_input_with_a_typed_4xx(server):
    st = server
    corpus = nats_corpus(st.actors["executor"].engine.spec.vocab_size)
    ex_id, sc_id = st.actors["executor"].instance, st.actors["scheduler"].instance
    corpus += [(subjects.executor_submit(ex_id), b"\xc1", {}),
               (subjects.executor_submit(ex_id), json.dumps({"rid": "q", "input_ids": [-1], "sampling": {}}).encode(),
                {"Content-Type": "application/json"}),
               (subjects.live("executor", ex_id), b"\xc1", {}), (subjects.live("scheduler", "nobody"), b"{}", {}),
               (subjects.resend(sc_id), b"\xc1", {}),
               (subjects.resend(sc_id), json.dumps({"subject": 5, "seq": "x"}).encode(), {"Content-Type": "application/json"})]
    nc = await nats.connect(st.nats.url)
    bad = []
    try:
        for subject, payload, headers in corpus:
            try:
                m = await nc.request(subject, payload, timeout=10, headers=headers or None)
            except nats.errors.NoRespondersError:
                if "nobody" in subject:
                    continue        # an instance that does not exist: nobody to answer, as expected
                bad.append(f"{subject}: no responders")
                continue
            except nats.errors.TimeoutError:
                bad.append(f"{subject} {payload[:60]!r}: no answer in 10 s")
                continue
            try:
                reply = json.loads(m.data) if headers else msgspec.msgpack.decode(m.data)
            except Exception:
                bad.append(f"{subject}: undecodable reply {m.data[:80]!r}")
                continue
            if not (isinstance(reply, dict) and reply.get("type") == "ErrorReply" and 400 <= reply.get("code", 0) < 500):
                bad.append(f"{subject} {payload[:60]!r}: {str(reply)[:200]}")
    finally:
        await nc.close()
    assert not bad, "\n".join(bad)
    await assert_unharmed(st)


async def assert_unharmed(st) -> None:
    """No service crashed a loop, nothing is held, and a plain request is served."""
    assert all(a.restarts == 0 for a in st.actors.values()), {n: a.restarts for n, a in st.actors.items()}
    for _ in range(100):
        stats = [p.stats() for p in st.actors["radix"].pools.values()]
        if all(s["requests_held"] == 0 and s["kv_pages_used"] == s["kv_pages_cached"] for s in stats):
            break
        await asyncio.sleep(0.1)
    assert all(s["requests_held"] == 0 and s["kv_pages_used"] == s["kv_pages_cached"] for s in stats), stats
    async with st.http.post(st.base + "/generate", json=generate()) as r:
        assert r.status == 200, await r.text()


@pytest.fixture(scope="module")
async def server(models):
    st = await start(models["tiny-dense"])
    yield st
    await stop(st)
