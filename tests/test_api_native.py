"""The SGLang-native dialect against a live server: batched /generate, max_new_tokens 0 with prompt
logprobs, SGLang's logprob shapes, streaming with cumulative text, n, the information routes,
tokenize/detokenize, OpenAPI; and logprobs equal to log_softmax of the model's own logits
(transformers' forward of the same checkpoint), on a cache miss and on a cache hit."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixflow.services.gateway.openapi import ROUTES, spec

from .stacks import start, stop


@pytest.fixture(scope="module", params=["tiny-dense", "tiny-hybrid"])
async def server(request, models):
    st = await start(models[request.param])
    st.path = models[request.param]
    yield st
    await stop(st)


async def post(st, path: str, body: dict) -> tuple[int, dict | list]:
    async with st.http.post(st.base + path, json=body) as r:
        return r.status, await r.json()


def reference_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


async def test_logprobs_equal_the_models_own(server):
    rng = torch.Generator().manual_seed(7)
    prompt = torch.randint(300, 4000, (53,), generator=rng).tolist()
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 3}
    st1, miss = await post(server, "/generate", body | {"logprob_start_len": 0})
    # a cache hit: 48 tokens (3 pages) come from the cache (hybrid: from the state checkpointed at the
    # end of a prefill-only request), logprobs from position 49 on are computed
    await post(server, "/generate", {"input_ids": prompt[:48], "sampling_params": {"max_new_tokens": 0}})
    st2, hit = await post(server, "/generate", body | {"logprob_start_len": 49})
    assert st1 == st2 == 200, (miss, hit)
    assert miss["meta_info"]["cached_tokens"] == 0 and hit["meta_info"]["cached_tokens"] == 48
    ref = reference_logprobs(server.path, prompt + miss["output_ids"])
    for r, first in ((miss, 0), (hit, 49)):
        m = r["meta_info"]
        assert r["output_ids"] == miss["output_ids"]
        inp = m["input_token_logprobs"]
        assert len(inp) == len(prompt) - first and inp[0][0] is None and [e[1] for e in inp] == prompt[first:]
        got = torch.tensor([e[0] for e in inp[1:]])
        want = ref[torch.arange(first, len(prompt) - 1), torch.tensor(prompt[first + 1:])]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        for p, tops in zip(range(first, len(prompt) - 1), m["input_top_logprobs"][1:]):
            assert [t[1] for t in tops] == ref[p].topk(3).indices.tolist()
        out = m["output_token_logprobs"]
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out))
        torch.testing.assert_close(torch.tensor([e[0] for e in out]), ref[pos, torch.tensor(r["output_ids"])],
                                   atol=2e-4, rtol=1e-4)
        for p, tops in zip(pos.tolist(), m["output_top_logprobs"]):
            assert [t[1] for t in tops] == ref[p].topk(3).indices.tolist()
        assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == len(prompt) - first


async def test_prompt_logprobs_with_no_generation_and_a_start(server):
    st, r = await post(server, "/generate", {"text": "The capital of France is Paris",
                                             "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                             "logprob_start_len": 2, "return_text_in_logprobs": True})
    assert st == 200 and r["text"] == "" and r["output_ids"] == []
    m = r["meta_info"]
    entries = m["input_token_logprobs"]
    assert len(entries) == m["prompt_tokens"] - 2 and entries[0][0] is None      # as SGLang: none at the start
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in entries[1:])
    assert m["finish_reason"] == {"type": "length", "length": 0}
    # SGLang's default start (-1): no prompt logprobs, only the output's
    st, r = await post(server, "/generate", {"text": "The capital of France is Paris",
                                             "sampling_params": {"max_new_tokens": 1}, "return_logprob": True})
    assert st == 200 and r["meta_info"]["input_token_logprobs"] == []
    assert len(r["meta_info"]["output_token_logprobs"]) == 1


async def test_batches_n_and_streaming(server):
    st, r = await post(server, "/generate", {"text": ["The sky is", "The sea is"],
                                             "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert st == 200 and isinstance(r, list) and len(r) == 2
    st, one = await post(server, "/generate", {"text": "The sea is", "sampling_params": {"max_new_tokens": 3,
                                                                                          "temperature": 0}})
    assert r[1]["text"] == one["text"] and r[1]["output_ids"] == one["output_ids"]
    st, ids = await post(server, "/generate", {"input_ids": [[5, 6, 7], [8, 9, 10, 11]],
                                               "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]})
    assert st == 200 and [len(x["output_ids"]) for x in ids] == [2, 3]
    st, n = await post(server, "/generate", {"text": "Pick:", "sampling_params": {"max_new_tokens": 4, "n": 3,
                                                                                   "temperature": 1.0, "seed": 1}})
    assert st == 200 and len(n) == 3 and len({x["meta_info"]["id"] for x in n}) == 3
    texts = []
    async with server.http.post(server.base + "/generate", json={
            "text": "The sea is", "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) as resp:
        async for line in resp.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["text"])
    assert texts[-1] == one["text"] and all(one["text"].startswith(t) for t in texts)   # cumulative, as SGLang
    events = []
    async with server.http.post(server.base + "/generate", json={
            "text": "Two ways:", "stream": True, "rid": "two-ways",
            "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 1.0}}) as resp:
        async for line in resp.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    for i in (0, 1):      # each completion's events carry its index and one id throughout
        mine = [e for e in events if e["index"] == i]
        assert mine and {e["meta_info"]["id"] for e in mine} == {f"two-ways-{i}"}
        assert mine[-1]["meta_info"]["finish_reason"] is not None


async def test_information_routes(server):
    for route in ["/get_model_info", "/get_server_info", "/health_generate"]:
        async with server.http.get(server.base + route) as r:
            assert r.status == 200, route
    st, tok = await post(server, "/tokenize", {"text": "hello world"})
    assert st == 200 and tok["count"] == len(tok["tokens"]) > 0
    st, det = await post(server, "/detokenize", {"tokens": tok["tokens"]})
    assert st == 200 and det["text"] == "hello world"
    st, bad = await post(server, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1, "bogus": 1}})
    assert st == 400 and "bogus" in bad["error"]["message"]
    st, bad = await post(server, "/generate", {"text": ["a", "b"], "stream": True})
    assert st == 400 and bad["error"]["param"] == "stream"


async def test_openapi_describes_every_route(server):
    async with server.http.get(server.base + "/openapi.json") as r:
        served = await r.json()
    assert served == json.loads(json.dumps(spec()))
    app = server.actors["gateway"].app
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    described = {(m, p) for p, ops in served["paths"].items() for m in ops}
    assert routes == described == {(m, p) for m, p, *_ in ROUTES}
    body = served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatBody") and "logprobs" in served["components"]["schemas"]["ChatBody"]["properties"]


def test_openapi_in_schemas_is_current():
    from radixflow.services.gateway import openapi
    path = openapi.path_in(os.path.join(os.path.dirname(__file__), "..", "schemas"))
    assert open(path).read() == openapi.render(), "run `radixflow schemas`"
