"""Load a Hugging Face checkpoint (safetensors, sharded or not, or PyTorch .bin) into radixflow's CausalLM.

Checkpoint names follow transformers' Llama / Mistral / Qwen2 / Qwen3 / Qwen3Moe / Qwen3_5 ForCausalLM (the
dense ones share every name; Qwen3 adds q_norm / k_norm, Qwen2 q/k/v biases, Qwen3-MoE a router and
experts per sparse layer, stacked here); Qwen3.5's multimodal
checkpoints (`model.language_model.*`) load too, their vision tower and MTP head skipped. Projections
that run back to back are fused here (q|k|v, gate|up, DeltaNet's qkv|z|b|a) so a step does fewer matmuls.
"""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from .spec import ModelSpec
from .transformer import CausalLM

_SKIP = ("model.visual.", "mtp.", "model.language_model.visual.")


def weight_files(path: str) -> list[str]:
    """The checkpoint's weight files, as transformers picks them: the shards an index names (a
    directory may also hold other weights, such as Mistral's consolidated.safetensors), else
    model.safetensors, else the PyTorch .bin files (weights only: nothing in them is executed)."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if os.path.exists(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                return [os.path.join(path, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
        if os.path.exists(os.path.join(path, single)):
            return [os.path.join(path, single)]
    files = sorted(f for f in glob.glob(os.path.join(path, "*.safetensors")) if "consolidated" not in f)
    if not files:
        raise FileNotFoundError(f"no weights in {path}: neither *.safetensors nor pytorch_model.bin")
    return files


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        if f.endswith(".bin"):
            tensors = torch.load(f, map_location="cpu", weights_only=True)
        else:
            with safe_open(f, framework="pt") as st:
                tensors = {name: st.get_tensor(name) for name in st.keys()}
        for name, t in tensors.items():
            # older Llama checkpoints store the rotary frequencies, which the config determines
            if name.startswith(_SKIP) or name.endswith("rotary_emb.inv_freq"):
                continue
            out[name.replace("model.language_model.", "model.")] = t
    return out


def _remap(spec: ModelSpec, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> CausalLM state_dict names (fusing projections)."""
    sd: dict[str, torch.Tensor] = {"embed.weight": w.pop("model.embed_tokens.weight"),
                                   "norm.weight": w.pop("model.norm.weight")}
    head = w.pop("lm_head.weight", None)
    sd["lm_head.weight"] = sd["embed.weight"] if head is None or spec.tie_word_embeddings else head
    for i, kind in enumerate(spec.layer_types):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        sd[dst + "input_norm.weight"] = w.pop(src + "input_layernorm.weight")
        sd[dst + "post_norm.weight"] = w.pop(src + "post_attention_layernorm.weight")
        if i in spec.moe_layers:
            m = src + "mlp."
            sd[dst + "mlp.router.weight"] = w.pop(m + "gate.weight")
            if m + "experts.gate_up_proj" in w:        # transformers 5's own stacked layout
                sd[dst + "mlp.gate_up"], sd[dst + "mlp.down"] = w.pop(m + "experts.gate_up_proj"), \
                    w.pop(m + "experts.down_proj")
            else:                                       # the hub's: one module per expert
                ex = [f"{m}experts.{e}." for e in range(spec.num_experts)]
                sd[dst + "mlp.gate_up"] = torch.stack([torch.cat([w.pop(x + "gate_proj.weight"),
                                                                  w.pop(x + "up_proj.weight")]) for x in ex])
                sd[dst + "mlp.down"] = torch.stack([w.pop(x + "down_proj.weight") for x in ex])
        else:
            sd[dst + "mlp.gate_up.weight"] = torch.cat([w.pop(src + "mlp.gate_proj.weight"),
                                                        w.pop(src + "mlp.up_proj.weight")])
            sd[dst + "mlp.down.weight"] = w.pop(src + "mlp.down_proj.weight")
        if kind == "full_attention":
            a = src + "self_attn."
            sd[dst + "mixer.qkv.weight"] = torch.cat([w.pop(a + "q_proj.weight"), w.pop(a + "k_proj.weight"), w.pop(a + "v_proj.weight")])
            sd[dst + "mixer.o.weight"] = w.pop(a + "o_proj.weight")
            if spec.qk_norm:
                sd[dst + "mixer.q_norm.weight"] = w.pop(a + "q_norm.weight")
                sd[dst + "mixer.k_norm.weight"] = w.pop(a + "k_norm.weight")
            if spec.qkv_bias:
                sd[dst + "mixer.qkv.bias"] = torch.cat([w.pop(a + "q_proj.bias"), w.pop(a + "k_proj.bias"),
                                                        w.pop(a + "v_proj.bias")])
            if spec.o_bias:
                sd[dst + "mixer.o.bias"] = w.pop(a + "o_proj.bias")
        else:
            a = src + "linear_attn."
            sd[dst + "mixer.in_proj.weight"] = torch.cat([w.pop(a + "in_proj_qkv.weight"), w.pop(a + "in_proj_z.weight"),
                                                          w.pop(a + "in_proj_b.weight"), w.pop(a + "in_proj_a.weight")])
            sd[dst + "mixer.conv_weight"] = w.pop(a + "conv1d.weight").squeeze(1)   # [C, 1, W] -> [C, W]
            sd[dst + "mixer.dt_bias"] = w.pop(a + "dt_bias")
            sd[dst + "mixer.A_log"] = w.pop(a + "A_log")
            sd[dst + "mixer.norm.weight"] = w.pop(a + "norm.weight")
            sd[dst + "mixer.out_proj.weight"] = w.pop(a + "out_proj.weight")
    if w:
        raise ValueError(f"unexpected tensors in checkpoint: {sorted(w)[:5]}{' ...' if len(w) > 5 else ''}")
    return sd


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> CausalLM:
    spec = ModelSpec.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(spec)
    sd = _remap(spec, _read_tensors(path))
    # A_log / dt_bias / norms stay fp32: the decay exp(-exp(A_log)) is sensitive to rounding
    keep_fp32 = ("A_log", "dt_bias", "conv_weight")
    sd = {k: v.to(device=device, dtype=torch.float32 if k.endswith(keep_fp32) else dtype) for k, v in sd.items()}
    model = model.to_empty(device=device)
    # assign: the parameters take the tensors' dtypes (a copy into the fp32 modules would upcast
    # every weight back to fp32 and leave the serving dtype on paper only)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.rotary.materialize(device)
    model.eval()
    return model
