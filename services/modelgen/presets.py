"""Shapes of the tiny random models used to test the runtime, and their Hugging Face config.json.

The presets share every size so that a test can swap one for another and only the architecture changes:
``tiny-dense`` is Qwen3 (all full attention), ``tiny-hybrid`` is Qwen3.5's text model (three Gated DeltaNet
layers, then one gated full-attention layer with partial, multimodal-layout RoPE); ``tiny-llama`` (Llama
3.2's shape: llama3 rope scaling, tied embeddings), ``tiny-qwen2`` (Qwen2.5's: q/k/v biases, tied) and
``tiny-mistral`` (no q/k norm, untied, Mistral 7B v0.1's sliding window scaled down to 48 tokens) are the dense decoders users bring most.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .chat_formats import FORMATS

# Token ids fixed by the shipped tokenizer (see train_tokenizer.SPECIAL_TOKENS).
ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2
# The chat end marker is the primary stop; <|endoftext|> also stops, as in Qwen's generation_config.
GENERATION_EOS_IDS = [IM_END_ID, ENDOFTEXT_ID]


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    architecture: str
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    # Hybrid-only fields; ignored for the dense preset.
    full_attention_interval: int = 0
    partial_rotary_factor: float = 1.0
    mrope_section: tuple[int, ...] = field(default_factory=tuple)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    tie_word_embeddings: bool = False
    # Dense families: Qwen3's per-head q/k norm, q/k/v biases (Qwen2), rope scaling (Llama 3.x's llama3)
    qk_norm: bool = True
    qkv_bias: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # Qwen3-MoE: experts per sparse layer, how many each token takes, their width; dense-MLP layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    # Mistral: every layer attends over a sliding window of this many tokens (0: none)
    sliding_window: int = 0
    # the family's chat template and the special tokens it adds after the BPE vocabulary (chat_formats.py);
    # vocab_size counts them
    chat_format: str = "chatml"
    # The tokenizer's <|endoftext|> and <|im_end|>: config.json's pad / eos, and the generation stops.
    endoftext_id: int = ENDOFTEXT_ID
    im_end_id: int = IM_END_ID

    @property
    def is_hybrid(self) -> bool:
        return self.full_attention_interval > 0

    @property
    def layer_types(self) -> list[str]:
        if not self.is_hybrid:
            return ["full_attention"] * self.num_hidden_layers
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.num_experts and i not in self.mlp_only_layers]

    @property
    def generation_eos_ids(self) -> list[int]:
        if self.chat_format in ("chatml", "qwen2.5"):
            return [self.im_end_id, self.endoftext_id]
        return [token_id(self, t) for t in FORMATS[self.chat_format].stops]

    @property
    def bos_id(self) -> int | None:
        bos = FORMATS[self.chat_format].bos
        return None if bos is None else token_id(self, bos)

    @property
    def eos_id(self) -> int:
        return self.im_end_id if self.chat_format in ("chatml", "qwen2.5") else token_id(self, FORMATS[self.chat_format].eos)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


PRESETS: dict[str, Preset] = {
    "tiny-dense": Preset(
        name="tiny-dense",
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
    ),
    "tiny-hybrid": Preset(
        name="tiny-hybrid",
        model_type="qwen3_5_text",
        architecture="Qwen3_5ForCausalLM",
        rope_theta=1e7,
        full_attention_interval=4,
        partial_rotary_factor=0.25,
        # Must sum to rotary_dim / 2 = 8 frequency slots; text-only positions make the three sections
        # identical, but the runtime still has to honour the interleaved layout.
        mrope_section=(3, 3, 2),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    ),
}


PRESETS |= {
    "tiny-llama": Preset(
        name="tiny-llama", model_type="llama", architecture="LlamaForCausalLM", rope_theta=500000.0,
        qk_norm=False, tie_word_embeddings=True, chat_format="llama3", vocab_size=8192 + len(FORMATS["llama3"].added),
        # Llama 3.2's scaling: frequencies past an 8k-token wavelength slowed 32x, a band blended
        rope_scaling=(("rope_type", "llama3"), ("factor", 32.0), ("low_freq_factor", 1.0),
                      ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192)),
    ),
    "tiny-qwen2": Preset(
        name="tiny-qwen2", model_type="qwen2", architecture="Qwen2ForCausalLM", qk_norm=False, qkv_bias=True,
        tie_word_embeddings=True, chat_format="qwen2.5", vocab_size=8192 + len(FORMATS["qwen2.5"].added),
    ),
    "tiny-mistral": Preset(
        name="tiny-mistral", model_type="mistral", architecture="MistralForCausalLM", qk_norm=False,
        chat_format="mistral", vocab_size=8192 + len(FORMATS["mistral"].added),
        # shorter than the tests' prompts and cached prefixes, so that the window decides what is seen
        sliding_window=48,
    ),
    # Qwen3-30B-A3B's routing (8 of 128 experts, renormalized) scaled down: 2 of 8; layer 0 dense, so
    # both MLP kinds run in one model
    "tiny-moe": Preset(
        name="tiny-moe", model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=192, mlp_only_layers=(0,),
    ),
}


# the shipped BPE's size: a chat format's added tokens take the ids from here on
BASE_VOCAB = 8192
_BASE_SPECIALS = {"<|endoftext|>": ENDOFTEXT_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}


def added_tokens(p: Preset) -> list[tuple[int, str, bool]]:
    """(id, text, special) of the tokens p's chat format adds after the BPE vocabulary."""
    return [(BASE_VOCAB + i, t, special) for i, (t, special) in enumerate(FORMATS[p.chat_format].added)]


def token_id(p: Preset, text: str) -> int:
    ids = _BASE_SPECIALS | {t: i for i, t, _ in added_tokens(p)}
    return ids[text]


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def hf_config(preset: str | Preset) -> dict[str, Any]:
    """The config.json dict for a preset, in the layout transformers 5 reads natively (rope in
    ``rope_parameters``, ``dtype`` rather than ``torch_dtype``)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    cfg: dict[str, Any] = {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": p.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": p.tie_word_embeddings,
        "use_cache": True,
        "layer_types": p.layer_types,
        "bos_token_id": p.bos_id,
        "eos_token_id": p.eos_id,
        "pad_token_id": p.endoftext_id,
        "dtype": "float32",
    }
    if not p.is_hybrid:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": p.rope_theta} | dict(p.rope_scaling)
        cfg["sliding_window"] = p.sliding_window or None
        if p.model_type in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
            cfg["max_window_layers"] = p.num_hidden_layers
        if p.model_type in ("llama", "mistral"):
            del cfg["layer_types"]      # as their real configs: transformers reads a Mistral with it as Ministral
        if p.model_type == "llama":
            cfg["mlp_bias"] = False
        if p.num_experts:
            cfg.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                       moe_intermediate_size=p.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=list(p.mlp_only_layers), output_router_logits=False,
                       router_aux_loss_coef=0.001)
        return cfg

    if sum(p.mrope_section) * 2 != p.rotary_dim:
        raise ValueError(f"mrope_section {p.mrope_section} does not cover rotary_dim {p.rotary_dim}")
    cfg["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": p.rope_theta,
        "partial_rotary_factor": p.partial_rotary_factor,
        "mrope_section": list(p.mrope_section),
        "mrope_interleaved": True,
    }
    cfg.update(
        full_attention_interval=p.full_attention_interval,
        linear_num_key_heads=p.linear_num_key_heads,
        linear_num_value_heads=p.linear_num_value_heads,
        linear_key_head_dim=p.linear_key_head_dim,
        linear_value_head_dim=p.linear_value_head_dim,
        linear_conv_kernel_dim=p.linear_conv_kernel_dim,
    )
    return cfg


# Not a preset (no weights are made for it): the shapes of a Qwen3.5-27B-class hybrid, as its
# config.json gives them, for the memory calculator's reference figures and `bench kernels`
QWEN35_27B = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
              "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
              "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "torch_dtype": "bfloat16", "max_position_embeddings": 262144}
