"""make_model writes checkpoints that transformers loads exactly and that are fit for cache-exactness tests."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from radixflow.services.modelgen.make import make_model, make_weights
from radixflow.services.modelgen.chat_formats import FORMATS
from radixflow.services.modelgen.presets import PRESETS, added_tokens, get_preset, hf_config
from radixflow.services.tokenizer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

PRESET_NAMES = sorted(PRESETS)
EXPECTED_CLASS = {"tiny-dense": "Qwen3ForCausalLM", "tiny-hybrid": "Qwen3_5ForCausalLM",
                  "tiny-llama": "LlamaForCausalLM", "tiny-qwen2": "Qwen2ForCausalLM",
                  "tiny-mistral": "MistralForCausalLM", "tiny-moe": "Qwen3MoeForCausalLM"}
EXPECTED_CONFIG_CLASS = {"tiny-dense": "Qwen3Config", "tiny-hybrid": "Qwen3_5TextConfig", "tiny-llama": "LlamaConfig",
                         "tiny-qwen2": "Qwen2Config", "tiny-mistral": "MistralConfig", "tiny-moe": "Qwen3MoeConfig"}
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(name, root / name, seed=0) for name in PRESET_NAMES}


@pytest.fixture(scope="module")
def loaded(model_dirs):
    out = {}
    for name, d in model_dirs.items():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        out[name] = (model.eval(), info)
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_files_present(model_dirs, name):
    d = model_dirs[name]
    for f in FILES:
        assert (d / f).is_file(), f
    gen = json.loads((d / "generation_config.json").read_text())
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    tok = Tokenizer(d)
    p = get_preset(name)
    # the family's chat format adds its tokens after the BPE's 8,192 (chat_formats.py)
    assert tok.vocab_size == p.vocab_size == 8192 + len(FORMATS[p.chat_format].added)
    assert gen["pad_token_id"] == 0 and tok_cfg["pad_token"] == "<|endoftext|>"
    if p.chat_format in ("chatml", "qwen2.5"):
        assert gen["eos_token_id"] == [2, 0] and tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] is None
        assert tok.eos_token_ids == {0, 2}
    else:
        stops = {tok._tok.convert_tokens_to_ids(t) for t in FORMATS[p.chat_format].stops}
        assert set(gen["eos_token_id"]) == stops and tok.eos_token_ids == stops | {p.eos_id}
        assert tok_cfg["bos_token"] == FORMATS[p.chat_format].bos
        assert tok.encode(FORMATS[p.chat_format].bos) == [p.bos_id]        # one special token
    added = [i for i, _, special in added_tokens(p) if special]
    assert tok.special_ids == {0, 1, 2} | set(added)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_config_loads_with_right_class(model_dirs, name):
    cfg = transformers.AutoConfig.from_pretrained(model_dirs[name])
    assert type(cfg).__name__ == EXPECTED_CONFIG_CLASS[name]
    want = hf_config(name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "layer_types", "eos_token_id", "pad_token_id", "bos_token_id"):
        if key in want:           # Llama's and Mistral's configs have no layer_types
            assert getattr(cfg, key) == want[key], key
    assert cfg.rope_parameters["rope_type"] == want["rope_parameters"]["rope_type"]
    assert cfg.rope_parameters["rope_theta"] == want["rope_parameters"]["rope_theta"]
    if name == "tiny-hybrid":
        assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
        assert cfg.rope_parameters["mrope_section"] == [3, 3, 2]
        assert cfg.rope_parameters["mrope_interleaved"] is True
        assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
        assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (64, 64, 4)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_loads_without_missing_or_unexpected_keys(loaded, model_dirs, name):
    model, info = loaded[name]
    assert type(model).__name__ == EXPECTED_CLASS[name]
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info.get(kind))
    # Loaded tensors must be ours bit for bit: no silent re-initialisation or conversion on load.
    ours = load_file(str(model_dirs[name] / "model.safetensors"))
    theirs = model.state_dict()
    if model.config.tie_word_embeddings:      # the head is the embedding, not a tensor of the file
        assert theirs.pop("lm_head.weight").data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    for layer in sorted({k.split(".experts.")[0] for k in ours if ".experts." in k}):
        # transformers 5 stacks the hub's per-expert modules on load: [E, 2I, H] (gate over up), [E, H, I]
        n = sum(1 for k in ours if k.startswith(layer + ".experts.") and k.endswith("down_proj.weight"))
        per = [{w: ours.pop(f"{layer}.experts.{e}.{w}_proj.weight") for w in ("gate", "up", "down")} for e in range(n)]
        ours[layer + ".experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in per])
        ours[layer + ".experts.down_proj"] = torch.stack([x["down"] for x in per])
    assert set(ours) == set(theirs)
    for key, tensor in ours.items():
        assert torch.equal(theirs[key], tensor), key


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_same_seed_same_bytes(tmp_path, model_dirs, name):
    again = make_model(name, tmp_path / "again", seed=0)
    for f in FILES:
        assert _sha(again / f) == _sha(model_dirs[name] / f), f
    other = make_weights(name, seed=1)
    assert not torch.equal(other["model.embed_tokens.weight"], load_file(str(again / "model.safetensors"))[
        "model.embed_tokens.weight"])


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_logit_scale_and_distant_context(loaded, name):
    model, _ = loaded[name]
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, 8192, (1, 256), generator=g)
    changed = ids.clone()
    # 200 positions before the last one; a sliding window (tiny-mistral's 48 over 4 layers reaches
    # 188 back) moves it to just past one window, which only the stacked layers see across
    far = 1 + (get_preset(name).sliding_window + 10 if get_preset(name).sliding_window else 200)
    changed[0, -far] = 3 + (int(ids[0, -far]) + 1000) % 8189
    with torch.no_grad():
        logits = model(torch.cat([ids, changed])).logits.float()
    base, alt = logits[0, -1], logits[1, -1]

    std = base.std().item()
    assert 3.0 <= std <= 5.0, std
    # Greedy margins: any single position can be a near tie, but typical gaps must dwarf float noise.
    top2 = logits[0, -64:].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median().item() > 0.3

    max_diff = (base - alt).abs().max().item()
    rel = ((base - alt).norm() / base.norm()).item()
    # Measured 0.27-1.0 max |diff| and 2-6% relative (see make.py); float noise is ~1e-6.
    assert max_diff > 0.1, max_diff
    assert rel > 5e-3, rel


def test_a_cached_preset_is_made_again_when_the_preset_changed(tmp_path):
    """A cache written by an older radixflow (another config or chat format under the preset's name)
    is replaced, not served; an unchanged one is kept."""
    from radixflow.services.modelgen.make import cached_preset
    path = cached_preset("tiny-mistral", tmp_path)
    made = (path / "model.safetensors").stat().st_mtime_ns
    assert cached_preset("tiny-mistral", tmp_path) == path and (path / "model.safetensors").stat().st_mtime_ns == made
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"sliding_window": None}))      # as an older preset wrote it
    (path / ".radixflow-preset").write_text("older\n")
    cached_preset("tiny-mistral", tmp_path)
    assert json.loads((path / "config.json").read_text())["sliding_window"] == 48
