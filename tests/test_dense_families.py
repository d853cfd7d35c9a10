"""The decoders users bring (Llama 3.x, Qwen2 / 2.5, Mistral, Qwen3-MoE) on radixflow's one model code: the
served engine's greedy tokens equal transformers' `generate` with a cached prefix shared, rope scaling
equals transformers' for each type, and what the model code cannot run is refused with a reason.
Per-position logits parity for these presets is in test_model_parity.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

from radixflow.services.executor.engine import Engine, EngineConfig
from radixflow.services.executor.models import ModelSpec, load_model
from radixflow.services.executor.models.layers import attention_factor, inv_freq
from radixflow.shared.messages import ExecRequest, SamplingParams

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-moe"]


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 8000, (n,), generator=g).tolist()


def _run(engine: Engine, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.add(ExecRequest(rid=rid, input_ids=p, eos_token_ids=[],
                               sampling=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for _, o in engine.step():
            out.setdefault(o.rid, []).extend(o.token_ids)
    return out


@pytest.mark.parametrize("preset", FAMILIES)
def test_engine_greedy_equals_transformers_generate_with_a_cached_prefix(preset, models):
    from transformers import AutoModelForCausalLM
    path = models[preset]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = _prompt(1, 160)
    prompts = {"a": base + _prompt(2, 30), "b": base + _prompt(3, 45), "c": _prompt(4, 70)}
    want = {}
    for rid, p in prompts.items():
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        want[rid] = out[0, len(p):].tolist()
    engine = Engine(EngineConfig(model=path, page_size=16, max_total_tokens=8192, max_running_requests=8,
                                 max_prefill_tokens=2048))
    first = _run(engine, {"a": prompts["a"]}, 10)                 # leaves `base` in the cache
    rest = _run(engine, {"b": prompts["b"], "c": prompts["c"]}, 10)
    assert first["a"] == want["a"] and rest == {"b": want["b"], "c": want["c"]}
    assert engine.stats()["cached_tokens_total"] >= 160            # b's shared prefix came from the cache


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},          # Qwen2.5's
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707},
])
def test_rope_scaling_equals_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theta = 500000.0
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=131072,
                      rope_parameters={"rope_theta": theta} | rope)
    want, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, torch.device("cpu"))
    sc = dict(ModelSpec.from_config(cfg.to_dict() | {"model_type": "llama", "rope_parameters": {"rope_theta": theta}
                                                     | rope}).rope_scaling)
    got = inv_freq(64, theta, rope["rope_type"], sc)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
    assert attention_factor(rope["rope_type"], sc) == pytest.approx(scale or 1.0)
    assert not torch.equal(got, inv_freq(64, theta))      # the scaling changed something


def _config(models, preset: str, **changes) -> dict:
    with open(os.path.join(models[preset], "config.json")) as f:
        return json.load(f) | changes


@pytest.mark.parametrize("preset,changes,match", [
    ("tiny-llama", {"mlp_bias": True}, "MLP biases"),
    ("tiny-llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}}, "dynamic"),
    ("tiny-llama", {"model_type": "gpt2"}, "unsupported model_type"),
])
def test_what_the_model_code_cannot_run_is_refused_with_a_reason(models, preset, changes, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_config(_config(models, preset, **changes))


def test_yarn_scaled_model_decodes_as_transformers(models, tmp_path):
    """Qwen2.5's long-context setting (YaRN, factor 4) on the tiny Qwen2, the attention factor
    included: the engine's greedy tokens equal transformers' `generate`."""
    import shutil
    from transformers import AutoModelForCausalLM
    path = tmp_path / "yarn"
    shutil.copytree(models["tiny-qwen2"], path)
    cfg = _config(models, "tiny-qwen2", max_position_embeddings=8192)
    cfg["rope_parameters"] = cfg["rope_parameters"] | {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 2048}
    (path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(str(path), torch.device("cpu"), torch.float32)
    assert ours.rotary.cos.abs().max() > 1.0                   # scaled by 0.1 ln 4 + 1
    ids = _prompt(9, 300)
    engine = Engine(EngineConfig(model=str(path), page_size=16, max_total_tokens=4096, max_running_requests=2))
    got = _run(engine, {"y": ids}, 6)["y"]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == want[0, len(ids):].tolist()


def test_sliding_windows_are_read_per_layer_as_transformers_applies_them(models):
    assert ModelSpec.from_dir(models["tiny-mistral"]).layer_windows == (48,) * 4
    assert ModelSpec.from_config(_config(models, "tiny-mistral", sliding_window=32768)).layer_windows == ()
    assert ModelSpec.from_config(_config(models, "tiny-mistral", sliding_window=None)).layer_windows == ()
    # Qwen2's window only with use_sliding_window, from max_window_layers on
    assert ModelSpec.from_config(_config(models, "tiny-qwen2", sliding_window=64)).layer_windows == ()
    qwen2 = _config(models, "tiny-qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    del qwen2["layer_types"]
    assert ModelSpec.from_config(qwen2).layer_windows == (0, 0, 64, 64)
    assert ModelSpec.from_config(_config(models, "tiny-moe", use_sliding_window=True, sliding_window=64)
                                 ).layer_windows == (64,) * 4


def test_a_window_on_some_layers_decodes_as_transformers(models, tmp_path):
    """Qwen2 with use_sliding_window on its last two layers (a 24-token window, shorter than the
    cached prefix): the engine's greedy tokens equal transformers' `generate`, the prefix reused."""
    import shutil
    from transformers import AutoModelForCausalLM
    path = tmp_path / "windowed"
    shutil.copytree(models["tiny-qwen2"], path)
    cfg = _config(models, "tiny-qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=2)
    del cfg["layer_types"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert ModelSpec.from_dir(str(path)).layer_windows == (0, 0, 24, 24)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    base = _prompt(5, 70)
    prompts = {"a": base + _prompt(6, 9), "b": base + _prompt(7, 40)}
    want = {}
    for rid, p in prompts.items():
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        want[rid] = out[0, len(p):].tolist()
    engine = Engine(EngineConfig(model=str(path), page_size=16, max_total_tokens=4096, max_running_requests=4))
    assert _run(engine, {"a": prompts["a"]}, 8) == {"a": want["a"]}
    assert _run(engine, {"b": prompts["b"]}, 8) == {"b": want["b"]}
    assert engine.stats()["cached_tokens_total"] >= 64


def test_qwen2_biases_and_llama_tied_head_are_loaded(models):
    qwen2 = load_model(models["tiny-qwen2"], torch.device("cpu"), torch.float32)
    attn = qwen2.layers[0].mixer
    assert attn.qkv.bias is not None and attn.o.bias is None and not attn.qk_norm
    assert attn.qkv.bias.abs().sum() > 0
    llama = load_model(models["tiny-llama"], torch.device("cpu"), torch.float32)
    assert llama.lm_head.weight.data_ptr() == llama.embed.weight.data_ptr()


def test_models_lists_every_supported_architecture_with_a_preset_that_tests_it(models):
    import subprocess
    import sys
    from radixflow.services.executor.models.spec import FAMILIES, SUPPORTED
    assert set(FAMILIES) == set(SUPPORTED) - {"qwen3_5"}          # qwen3_5: an alias of its text part
    for mt, f in FAMILIES.items():
        assert ModelSpec.from_dir(models[f["preset"]]).model_type == mt
    out = subprocess.run([sys.executable, "-m", "radixflow.services.cli.main", "models", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["model_types"] == FAMILIES


def test_moe_runs_only_the_chosen_experts(models):
    """A step's expert matmuls cover top_k experts per token, not all of them: with one token only
    top_k experts compute, and an expert nobody chose may hold garbage without changing the output."""
    m = load_model(models["tiny-moe"], torch.device("cpu"), torch.float32)
    moe = m.layers[1].mlp
    x = torch.randn(1, moe.gate_up.shape[2], generator=torch.Generator().manual_seed(0))
    chosen = torch.softmax(torch.nn.functional.linear(x, moe.router.weight), -1).topk(moe.top_k).indices[0].tolist()
    want = moe(x)
    idle = next(e for e in range(moe.gate_up.shape[0]) if e not in chosen)
    with torch.no_grad():
        moe.gate_up[idle].fill_(float("nan"))
    assert torch.equal(moe(x), want)
