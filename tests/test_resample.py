"""Check and resample: what no grammar enforces (here `uniqueItems`) is checked on the finished
output; a failing output is sampled again with another seed, up to max_resamples times, then a
clear error. The stream of a checked schema holds its text until the check passes; an enforced
schema streams live. The response says which engine enforced what (headers, meta_info)."""
from __future__ import annotations

import asyncio
import json

import pytest

from . import stacks

UNIQUE = {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "minItems": 3, "maxItems": 3, "uniqueItems": True}
PLAIN = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 24}}, "required": ["word"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
async def srv(models):
    st = await stacks.start(models["tiny-hybrid"], sc_max_resamples=12)
    yield st
    await stacks.stop(st)


def chat(schema, seed, **extra):
    return {"model": "tiny-hybrid", "messages": [{"role": "user", "content": "Pick three."}], "max_tokens": 64,
            "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}} | extra


async def test_unique_items_are_resampled_until_valid(srv):
    async def one(seed):
        async with srv.http.post(srv.base + "/v1/chat/completions", json=chat(UNIQUE, seed)) as r:
            return r.status, r.headers, await r.json()
    results = await asyncio.gather(*(one(s) for s in range(6)))
    resampled = 0
    for status, headers, body in results:
        if status != 200:       # all 13 attempts failed: a clear error naming the attempts
            assert "after 13 attempts" in body["error"]["message"], body
            continue
        items = json.loads(body["choices"][0]["message"]["content"])
        assert len(items) == 3 and len(set(items)) == 3
        assert headers["x-radixflow-grammar-enforcement"] == "checked"
        resampled += int(headers["x-radixflow-resamples"])
    # 3 picks from 4 are all distinct with p = 3/8: six requests without a single resample would be rare
    assert resampled > 0 and sum(s == 200 for s, _, _ in results) >= 4


async def test_a_checked_stream_is_held_and_an_enforced_one_is_live(srv):
    async def chunks(schema):
        out = []
        async with srv.http.post(srv.base + "/v1/chat/completions", json=chat(schema, 3, stream=True)) as r:
            enforcement = r.headers.get("x-radixflow-grammar-enforcement")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    ev = json.loads(line[6:])
                    out += [c["delta"]["content"] for c in ev.get("choices", []) if c["delta"].get("content")]
        return enforcement, out
    (e1, held), (e2, live) = await asyncio.gather(chunks(UNIQUE), chunks(PLAIN))
    assert e1 == "checked" and len(held) <= 1          # the whole text at once, after the check (or an error)
    assert e2 == "full" and len(live) > 1              # token by token


async def test_native_meta_info_names_the_backend(srv):
    async with srv.http.post(srv.base + "/generate", json={
            "text": "JSON:", "sampling_params": {"max_new_tokens": 64, "json_schema": json.dumps(PLAIN)}}) as r:
        body = await r.json()
    g = body["meta_info"]["grammar"]
    assert g["backend"] in ("xgrammar", "llguidance") and g["enforcement"] == "full" and g["resamples"] == 0


async def test_grammar_compile_time_travels_to_the_response(srv):
    """The grammar service's own compile seconds: in meta_info and a header, 0 on a cache hit."""
    schema = json.dumps(dict(PLAIN, title="compile time"))     # a key no other test compiled
    got = []
    for _ in range(2):
        async with srv.http.post(srv.base + "/generate", json={
                "text": "JSON:", "sampling_params": {"max_new_tokens": 64, "json_schema": schema}}) as r:
            body = await r.json()
            got.append((body["meta_info"]["grammar"]["compile_s"], float(r.headers["x-radixflow-grammar-compile-ms"])))
    (first_s, first_ms), (hit_s, hit_ms) = got
    assert first_s > 0 and abs(first_ms - first_s * 1000) < 0.1
    assert hit_s == 0 and hit_ms == 0


async def test_an_output_no_attempt_can_pass_ends_in_a_clear_error_naming_the_attempts(srv):
    """Two distinct items from one allowed value: the grammar (without uniqueItems) allows only
    ["a","a"], the check refuses it every time, so every attempt is used and the request ends in an
    error that says so (never the invalid output)."""
    never = {"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    async with srv.http.post(srv.base + "/v1/chat/completions", json=chat(never, 0)) as r:
        status, body = r.status, await r.json()
    assert status != 200 and "choices" not in body, body
    assert "after 13 attempts" in body["error"]["message"], body
