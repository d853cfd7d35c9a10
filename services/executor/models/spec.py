"""ModelSpec: the few numbers radixflow's model code needs, read from a Hugging Face config.json.

One implementation serves two families. The dense decoders differ only in small switches: Llama
3.x (`llama`: no q/k norm, optional attention biases, llama3 / linear rope scaling), Mistral
(`mistral`: Llama's shape, every layer over a sliding window when its config sets one), Qwen2 /
Qwen2.5 (`qwen2`: q/k/v biases; a window on the layers from max_window_layers on, when
use_sliding_window) and Qwen3 (`qwen3`: per-head q/k RMSNorm). The hybrid is Qwen3.5
text (`qwen3_5_text`, or the text part of `qwen3_5`: Gated DeltaNet layers with a gated
full-attention layer every few layers, zero-centered RMSNorm, partial rotary embedding).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5")
ROPE_TYPES = ("default", "mrope", "linear", "llama3", "yarn")

# What `radixflow models` lists: per model_type, its transformers class, the tiny preset that tests it,
# and what it differs in. Every family has the radix cache, structured output and the CPU (C++) and
# Triton kernels; the hybrid alone keeps DeltaNet states, checkpointed in the cache.
_DENSE = "radix cache (paged KV), structured output, CPU and Triton kernels"
FAMILIES: dict[str, dict[str, str]] = {
    "llama": {"class": "LlamaForCausalLM", "preset": "tiny-llama", "serves": _DENSE,
              "notes": "Llama 3.x: llama3 rope scaling; attention_bias; tied or untied head"},
    "mistral": {"class": "MistralForCausalLM", "preset": "tiny-mistral", "serves": _DENSE,
                "notes": "sliding-window attention (v0.1's 4096) or none (v0.2 and later); the window masks, every page is kept"},
    "qwen2": {"class": "Qwen2ForCausalLM", "preset": "tiny-qwen2", "serves": _DENSE,
              "notes": "Qwen2 / Qwen2.5: q/k/v biases; YaRN for long context; use_sliding_window on the layers it names"},
    "qwen3": {"class": "Qwen3ForCausalLM", "preset": "tiny-dense", "serves": _DENSE,
              "notes": "per-head q/k RMSNorm"},
    "qwen3_moe": {"class": "Qwen3MoeForCausalLM", "preset": "tiny-moe", "serves": _DENSE,
                  "notes": "Qwen3's attention, sparse MoE MLPs (top-k routing; a CPU step runs only the chosen "
                           "experts, by torch's matmuls)"},
    "qwen3_5_text": {"class": "Qwen3_5ForCausalLM", "preset": "tiny-hybrid",
                     "serves": _DENSE + ", DeltaNet state checkpoints at prefix boundaries",
                     "notes": "Gated DeltaNet + gated full attention (hybrid); qwen3_5 checkpoints load their text part"},
}


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    attn_output_gate: bool        # Qwen3.5: q_proj also yields a sigmoid gate on the attention output
    zero_centered_norm: bool      # Qwen3.5: RMSNorm scales by (1 + weight)
    lin_num_k_heads: int = 0
    lin_num_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0
    torch_dtype: str = "float32"
    qk_norm: bool = True          # Qwen3 / 3.5: RMSNorm over each head of q and k before rotary
    qkv_bias: bool = False        # Qwen2 (always), Llama / Qwen3 with attention_bias
    o_bias: bool = False          # Llama / Qwen3 with attention_bias (Qwen2's o_proj has none)
    # rotary scaling: its type and its parameters as (name, value) pairs (layers.inv_freq reads them)
    rope_type: str = "default"
    rope_scaling: tuple[tuple[str, float], ...] = ()
    # Qwen3-MoE: the layers whose MLP is a sparse mixture of experts, each token through top_k of them
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # sliding-window attention: per layer the keys a query sees (itself and the window - 1 before it),
    # 0 for the whole context; empty when no layer has a window. The pool keeps every page: the
    # window only masks (a windowed layer's pages before the window are never read)
    layer_windows: tuple[int, ...] = ()

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layers)

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_num_k_heads * self.lin_k_dim + self.lin_num_v_heads * self.lin_v_dim

    @classmethod
    def from_dir(cls, path: str) -> "ModelSpec":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_config(json.load(f))

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        mt = cfg.get("model_type")
        if mt not in SUPPORTED:
            raise ValueError(f"unsupported model_type {mt!r}; radixflow serves {', '.join(SUPPORTED)}")
        if mt == "qwen3_5":
            cfg = {**cfg["text_config"], "model_type": "qwen3_5_text"}
            mt = "qwen3_5_text"
        hybrid = mt == "qwen3_5_text"
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported (radixflow takes {', '.join(ROPE_TYPES)})")
        if cfg.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias: true) are not supported")
        bias = bool(cfg.get("attention_bias", False))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
        n = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if hybrid and not layer_types:
            every = cfg.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        if not hybrid:
            layer_types = ["full_attention"] * n
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        return cls(
            model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=n, num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rotary_dim=int(head_dim * partial), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), layer_types=tuple(layer_types),
            attn_output_gate=hybrid, zero_centered_norm=hybrid,
            lin_num_k_heads=cfg.get("linear_num_key_heads", 0), lin_num_v_heads=cfg.get("linear_num_value_heads", 0),
            lin_k_dim=cfg.get("linear_key_head_dim", 0), lin_v_dim=cfg.get("linear_value_head_dim", 0),
            conv_kernel=cfg.get("linear_conv_kernel_dim", 0), torch_dtype=str(dtype),
            qk_norm=mt in ("qwen3", "qwen3_moe", "qwen3_5_text"), qkv_bias=mt == "qwen2" or bias, o_bias=bias and mt != "qwen2",
            rope_type="default" if rope_type == "mrope" else rope_type,
            rope_scaling=_scaling(rope_type, rope, cfg), moe_layers=_moe_layers(mt, cfg, n),
            num_experts=cfg.get("num_experts", 0) if mt == "qwen3_moe" else 0,
            experts_per_token=cfg.get("num_experts_per_tok", 0), moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), layer_windows=_windows(mt, cfg, n, hybrid))


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(path: str) -> dict[str, float]:
    """The sampling fields a checkpoint's generation_config.json sets (Qwen's chat models: temperature
    0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), to serve requests that leave them unset, as
    vLLM and SGLang do."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            gen = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: float(gen[k]) for k in SAMPLING_KEYS if isinstance(gen.get(k), (int, float))
            and not isinstance(gen.get(k), bool)}


_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
                 "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def _scaling(rope_type: str, rope: dict[str, Any], cfg: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """The rope scaling's numbers (layers.inv_freq): YaRN's original context defaults to the
    model's, and its factor to the ratio of the two, as transformers reads them."""
    sc = {k: float(v) for k, v in rope.items() if k in _SCALING_KEYS and v is not None}
    if rope_type == "yarn":
        sc.setdefault("original_max_position_embeddings", float(cfg.get("max_position_embeddings", 32768)))
        sc.setdefault("factor", cfg.get("max_position_embeddings", 32768) / sc["original_max_position_embeddings"])
    return tuple(sorted(sc.items()))


def _moe_layers(mt: str, cfg: dict[str, Any], n: int) -> tuple[int, ...]:
    """Qwen3-MoE's sparse layers, as transformers picks them: every decoder_sparse_step-th layer
    not named in mlp_only_layers."""
    if mt != "qwen3_moe" or not cfg.get("num_experts"):
        return ()
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)


def _windows(mt: str, cfg: dict[str, Any], n: int, hybrid: bool) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers applies them: Mistral's on every layer whenever
    set (v0.1: 4096; v0.2 and later: null); Qwen2's and Qwen3's only with use_sliding_window, on the
    layers that layer_types calls sliding_attention (by default those from max_window_layers on);
    Qwen3-MoE's on every layer with use_sliding_window. A window at least the context is none."""
    window = cfg.get("sliding_window")
    on = cfg.get("use_sliding_window", mt == "mistral")
    if hybrid or not on or not window or window >= cfg.get("max_position_embeddings", 32768):
        return ()
    if mt in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", n)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        return windows if any(windows) else ()
    return (int(window),) * n
