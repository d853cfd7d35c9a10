"""The causal LM: embedding, pre-norm decoder blocks (attention or Gated DeltaNet, then SwiGLU or a mixture
of SwiGLU experts), norm, head."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from .attention import Attention
from .deltanet import GatedDeltaNet
from .layers import MLP, MoE, RMSNorm, Rotary
from .spec import ModelSpec

if TYPE_CHECKING:
    from ..memory import KVPool, StatePool


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, kind: str, rotary: Rotary, sparse: bool = False, window: int = 0):
        super().__init__()
        self.kind = kind
        self.mixer = Attention(spec, rotary, window) if kind == "full_attention" else GatedDeltaNet(spec)
        self.mlp = MoE(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.experts_per_token,
                       spec.norm_topk_prob) if sparse else MLP(spec.hidden_size, spec.intermediate_size)
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.zero_centered_norm)
        self.post_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.zero_centered_norm)

    def forward(self, x: torch.Tensor | None, stream: torch.Tensor, batch: ForwardBatch, mem_a: torch.Tensor,
                mem_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """stream: the residual stream up to the previous block; x: that block's output, not yet added
        (None at the first layer). Each norm adds its input to the stream in the same pass
        (RMSNorm.add; the stream is updated in place), so the sums cost no pass of their own.
        Returns (this block's output, not yet added; the stream before it)."""
        ops = batch.kernels
        if x is None:
            h = self.input_norm(stream, ops)
        else:
            stream, h = self.input_norm.add(stream, x, ops)
        stream, h = self.post_norm.add(stream, self.mixer(h, batch, mem_a, mem_b), ops)
        return self.mlp(h, ops), stream


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.rotary = Rotary(spec.rotary_dim, spec.rope_theta, spec.max_position_embeddings, spec.rope_type,
                             dict(spec.rope_scaling))
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        windows = spec.layer_windows or (0,) * spec.num_layers
        self.layers = nn.ModuleList(DecoderLayer(spec, t, self.rotary, i in spec.moe_layers, windows[i])
                                    for i, t in enumerate(spec.layer_types))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.zero_centered_norm)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # per layer: its index into the KV pool (attention) or the state pool (DeltaNet)
        self._mem_index = [spec.attn_layers.index(i) if t == "full_attention" else spec.linear_layers.index(i)
                           for i, t in enumerate(spec.layer_types)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: "KVPool", state: "StatePool | None", head: bool = True) -> torch.Tensor:
        """Run one step; returns logits [M, V] for batch.logits_rows (fp32), or with head=False their
        final hidden states [M, hidden] (the caller then picks which rows, or which tokens, get logits:
        verify.py: _verify)."""
        x, stream = None, self.embed(batch.input_ids)                       # [T, hidden]
        for layer, j in zip(self.layers, self._mem_index):
            if layer.kind == "full_attention":
                x, stream = layer(x, stream, batch, kv.k[j], kv.v[j])
            else:
                x, stream = layer(x, stream, batch, state.recurrent[j], state.conv[j])
        # the last block's output added only where logits are taken (rows: a tensor, so these are
        # copies and the in-place add leaves the stream alone)
        rows = batch.logits_rows
        x = self.norm.add(stream[rows], x[rows], batch.kernels)[1]
        return self.logits(x, batch.kernels) if head else x

    def logits(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        """The LM head over final hidden states, fp32, by the runner's kernels `ops`."""
        return ops.linear(hidden, self.lm_head.weight).float()
