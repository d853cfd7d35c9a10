"""Checkpoint layouts as they come from the hub: sharded safetensors with an index, PyTorch .bin where
no safetensors exist, bf16 weights served in fp32. Each loads to the same model as the one file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixflow.services.executor.models import load_model
from radixflow.services.executor.models.loader import weight_files

CPU = torch.device("cpu")


def _copy_without_weights(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-hybrid"])
def test_sharded_safetensors_with_an_index_equal_the_single_file(preset, models, tmp_path):
    weights = load_file(str(Path(models[preset]) / "model.safetensors"))
    out = _copy_without_weights(models[preset], tmp_path / "sharded")
    names = sorted(weights)
    shards = [names[i::3] for i in range(3)]                  # interleaved: every layer spans shards
    weight_map = {}
    for i, part in enumerate(shards):
        f = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: weights[n] for n in part}, str(out / f), metadata={"format": "pt"})
        weight_map |= {n: f for n in part}
    # a stray file beside the shards (Mistral ships consolidated.safetensors): the index decides
    save_file({"junk": torch.zeros(1)}, str(out / "consolidated.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * 4 for t in weights.values())}, "weight_map": weight_map}))
    assert len(weight_files(str(out))) == 3
    _same(load_model(str(out), CPU, torch.float32), load_model(models[preset], CPU, torch.float32))


def test_pytorch_bin_loads_where_no_safetensors_exist(models, tmp_path):
    out = _copy_without_weights(models["tiny-qwen2"], tmp_path / "bin")
    torch.save(load_file(str(Path(models["tiny-qwen2"]) / "model.safetensors")), out / "pytorch_model.bin")
    assert weight_files(str(out)) == [str(out / "pytorch_model.bin")]
    _same(load_model(str(out), CPU, torch.float32), load_model(models["tiny-qwen2"], CPU, torch.float32))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("serving", [torch.float32, torch.bfloat16])
def test_half_weights_are_served_in_the_serving_dtype(models, tmp_path, stored, serving):
    weights = load_file(str(Path(models["tiny-mistral"]) / "model.safetensors"))
    out = _copy_without_weights(models["tiny-mistral"], tmp_path / "half")
    save_file({n: t.to(stored) for n, t in weights.items()}, str(out / "model.safetensors"))
    m = load_model(str(out), CPU, serving)
    assert {p.dtype for p in m.parameters()} == {serving}
    assert torch.equal(m.embed.weight, weights["model.embed_tokens.weight"].to(stored).to(serving))


def test_a_directory_without_weights_is_a_clear_error(models, tmp_path):
    out = _copy_without_weights(models["tiny-llama"], tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(str(out), CPU, torch.float32)
