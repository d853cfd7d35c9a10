"""Sampling fields a request leaves unset come from the model's generation_config.json (as vLLM and
SGLang serve them), else from the API's defaults; `--sampling-defaults openai` keeps the API's."""
from __future__ import annotations

import json
import shutil

import pytest

from radixflow.services.executor.models.spec import sampling_defaults
from radixflow.services.gateway import protocol as P

from .stacks import start, stop


def test_unset_fields_take_the_models_then_the_apis_defaults():
    body = P.NativeSampling(top_p=0.5, min_p=0.0)          # set explicitly, even to the API default: kept
    got = P.native_sampling(body, defaults={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.1})
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (0.7, 0.5, 20, 0.0, 1.0)
    assert isinstance(got.top_k, int)
    plain = P.native_sampling(P.NativeSampling())
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (1.0, 1.0, -1, 0.0)


def test_generation_config_fields_are_read_and_others_ignored(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
         "eos_token_id": [2, 0], "max_new_tokens": 2048}))
    assert sampling_defaults(str(tmp_path)) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20.0,
                                                "repetition_penalty": 1.05}
    assert sampling_defaults(str(tmp_path / "absent")) == {}


async def _outputs(st, body: dict, seeds: list[int]) -> list[list[int]]:
    out = []
    for seed in seeds:
        sp = body | {"max_new_tokens": 16, "ignore_eos": True, "seed": seed}
        async with st.http.post(st.base + "/generate", json={"input_ids": list(range(40, 80)),
                                                             "sampling_params": sp}) as r:
            assert r.status == 200, await r.text()
            out.append((await r.json())["output_ids"])
    return out


@pytest.mark.parametrize("mode", ["model", "openai"])
async def test_a_models_greedy_default_serves_requests_that_set_no_temperature(models, tmp_path, mode):
    path = tmp_path / "greedy-by-default"
    shutil.copytree(models["tiny-llama"], path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | {"temperature": 0.0}))
    st = await start(str(path), ex_sampling_defaults=mode)
    try:
        unset = await _outputs(st, {}, [1, 2])
        explicit = await _outputs(st, {"temperature": 1.0}, [1, 2])
        async with st.http.get(st.base + "/v1/models") as r:
            assert r.status == 200
    finally:
        await stop(st)
    assert explicit[0] != explicit[1]                 # sampled at 1.0: two seeds, two outputs
    if mode == "model":
        assert unset[0] == unset[1]                   # the model's temperature 0: greedy whatever the seed
    else:
        assert unset[0] != unset[1]                   # the API's temperature 1
