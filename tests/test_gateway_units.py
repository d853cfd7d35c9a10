"""The gateway's plain pieces, without a server: model names, salts and namespaces, prompt forms,
SGLang's batch form, the logprob shapes of both dialects."""
from __future__ import annotations

import itertools

import pytest

from radixflow.services.gateway import protocol as P
from radixflow.services.gateway.state import resolve_model
from radixflow.services.gateway.auth import Principal
from radixflow.services.gateway.client import Choice, Result
from radixflow.services.gateway.native import native_body, requests_of
from radixflow.services.gateway.openai import chat_logprobs, completion_logprobs
from radixflow.services.scheduler.table import namespace_of
from radixflow.shared.errors import BadRequest, NotFound, ServiceUnavailable
from radixflow.shared.messages import TopLogprobs


def test_model_names():
    assert resolve_model(["a"], "a") == "a" and resolve_model(["a"], "gpt-4o") == "a"
    assert resolve_model(["a", "b"], "b") == "b"
    with pytest.raises(NotFound):
        resolve_model(["a", "b"], "c")
    with pytest.raises(ServiceUnavailable):
        resolve_model([], "a")


def test_no_client_salt_reaches_a_forced_salt_namespace():
    forced = Principal(tenant="eps", group="team", cache_salt="eps-only")
    plain = Principal(tenant="gamma", group="team")
    target = namespace_of(forced.scope, forced.salt(None))
    tries = ["eps-only", "s:eps-only", "c:eps-only", "", None, "eps-only|", "|c:"]
    for a, b in itertools.product(tries, tries):
        attempt = a if b is None else f"{a}{b}"
        assert namespace_of(plain.scope, plain.salt(attempt)) != target
        if attempt:
            assert namespace_of(forced.scope, forced.salt(attempt)) != target   # its own salts are its own too
    assert namespace_of(plain.scope, plain.salt(None)) == "g:team"               # groups share when unsalted
    assert Principal(tenant="team").scope != plain.scope                         # a tenant named like a group


def test_prompt_forms():
    assert P.prompts("x") == ["x"] and P.prompts(["x", "y"]) == ["x", "y"]
    assert P.prompts([1, 2]) == [[1, 2]] and P.prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [1, "x"], [[1], []], [True, 2]):
        with pytest.raises(BadRequest):
            P.prompts(bad)


def test_sglang_batch_form():
    body = P.decode_body(b'{"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],'
                         b' "return_logprob": [true, false], "logprob_start_len": 0, "top_logprobs_num": 2}',
                         P.GenerateBody)
    (r1, o1), (r2, o2) = requests_of(body)
    assert (r1.text, r1.sampling.max_new_tokens, r1.logprob_start, r1.sampling.top_logprobs) == ("a", 1, 0, 2)
    assert (r2.text, r2.sampling.max_new_tokens, r2.logprob_start, o2["logprob"]) == ("b", 2, -1, False)
    with pytest.raises(BadRequest):
        requests_of(P.decode_body(b'{"text": ["a", "b"], "rid": ["only-one"]}', P.GenerateBody))
    with pytest.raises(BadRequest):
        requests_of(P.decode_body(b'{"input_ids": [[1], "x"]}', P.GenerateBody))


def test_native_logprob_entries_start_with_none_as_sglang():
    texts = {5: "a", 6: "b", 7: "c", 9: "z"}
    tops = [TopLogprobs(ids=[9], logprobs=[-0.1])] * 3
    c = Choice(index=0, output_ids=[9], logprobs=[-0.5], top_logprobs=[TopLogprobs(ids=[9], logprobs=[-0.5])])
    opts = {"logprob": True, "top": 1}
    # start 0: the executor gives logprobs of tokens 1.. (two of three)
    r = Result(rid="r", prompt_tokens=3, choices=[c], input_ids=[5, 6, 7], input_logprobs=[-1.0, -2.0],
               input_top_logprobs=tops[:2])
    m = native_body(r, c, opts, texts, 0.0)["meta_info"]
    assert m["input_token_logprobs"] == [[None, 5, "a"], [-1.0, 6, "b"], [-2.0, 7, "c"]]
    assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == 3
    # start 1: the executor computed token 1's logprob too; SGLang reports None there
    r = Result(rid="r", prompt_tokens=3, choices=[c], input_ids=[6, 7], input_logprobs=[-1.0, -2.0],
               input_top_logprobs=tops[:2])
    m = native_body(r, c, opts, texts, 0.0)["meta_info"]
    assert m["input_token_logprobs"] == [[None, 6, "b"], [-2.0, 7, "c"]]
    assert m["output_token_logprobs"] == [[-0.5, 9, "z"]] and m["output_top_logprobs"] == [[[-0.5, 9, "z"]]]


def test_openai_logprob_shapes():
    texts = {1: "he", 2: "llo", 3: "!"}
    tops = [TopLogprobs(ids=[1, 3], logprobs=[-0.1, -2.0]), TopLogprobs(ids=[2, 1], logprobs=[-0.2, -3.0])]
    chat = chat_logprobs([1, 2], [-0.1, -0.2], tops, 1, texts)["content"]
    assert [t["token"] for t in chat] == ["he", "llo"] and chat[1]["bytes"] == list(b"llo")
    assert [len(t["top_logprobs"]) for t in chat] == [1, 1]
    comp = completion_logprobs([3, 1, 2], [None, -0.1, -0.2], [None] + tops, 2, texts)
    assert comp["tokens"] == ["!", "he", "llo"] and comp["text_offset"] == [0, 1, 3]
    assert comp["token_logprobs"] == [None, -0.1, -0.2] and comp["top_logprobs"][0] is None
    assert comp["top_logprobs"][2] == {"llo": -0.2, "he": -3.0}


def test_token_ids_are_checked_in_c_with_the_same_errors():
    from radixflow.shared.errors import BadRequest
    assert P.token_ids([0, 5, 70000], "input_ids", "bad") == [0, 5, 70000]
    for raw, needle in (([1, -2], "non-negative"), ([1, True], "bad"), ([1, 2.0], "bad"), ([1, "3"], "bad"),
                        ([[1]], "bad"), ("12", "bad")):
        with pytest.raises(BadRequest, match=needle):
            P.token_ids(raw, "input_ids", "bad")
    assert P.prompts([3, 4]) == [[3, 4]] and P.prompts([[3], [4, 5]]) == [[3], [4, 5]] and P.prompts(["a", "b"]) == ["a", "b"]
    for raw, needle in (([3, -4], "non-negative"), ([True, 2], "prompt must be"), ([[3], []], "prompt must be"),
                        ([[3], [True]], "prompt must be"), (["a", 3], "prompt must be")):
        with pytest.raises(BadRequest, match=needle):
            P.prompts(raw)


def test_a_negative_token_id_fails_to_decode_as_a_message():
    import msgspec
    from radixflow.shared import messages as M
    from radixflow.shared.messages import ExecRequest, GenerateRequest, SamplingParams
    for msg in (GenerateRequest(rid="a", stream_subject="s", input_ids=[1, -1]),
                ExecRequest(rid="a", input_ids=[1, -1], sampling=SamplingParams())):
        with pytest.raises(msgspec.ValidationError, match=">= 0"):
            M.decode(M.encode(msg), type(msg))
