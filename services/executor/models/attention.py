"""Full-attention layer over the paged KV pool (Qwen3 and Qwen3.5 norm q and k per head, Qwen3.5 adds an
output gate; Llama, Mistral and Qwen2 do neither, Qwen2 adds q/k/v biases). With a sliding window
(Mistral) a query sees itself and the window - 1 keys before it."""
from __future__ import annotations

import torch
from torch import nn

from ..forward_batch import ForwardBatch
from .layers import RMSNorm, Rotary
from .spec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: Rotary, window: int = 0):
        super().__init__()
        self.window = window
        self.h, self.hkv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.gated = spec.attn_output_gate
        q_out = self.h * self.d * (2 if self.gated else 1)
        self.q_size = q_out
        self.kv_size = self.hkv * self.d
        # q, k, v fused into one matmul; the loader concatenates the checkpoint's three weights
        self.qkv = nn.Linear(spec.hidden_size, q_out + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = nn.Linear(self.h * self.d, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.d, spec.rms_norm_eps, spec.zero_centered_norm)
            self.k_norm = RMSNorm(self.d, spec.rms_norm_eps, spec.zero_centered_norm)
        self.rotary = rotary
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = batch.kernels.linear(x, self.qkv.weight)
        if self.qkv.bias is not None:
            qkv.add_(self.qkv.bias)          # in place: qkv is the matmul's own output
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.gated:
            # per head the checkpoint lays out [query (D) | gate (D)]
            q, gate = q.view(T, self.h, 2 * self.d).chunk(2, dim=-1)
            gate = gate.reshape(T, self.h * self.d)
        q, k = q.reshape(T, self.h, self.d), k.reshape(T, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q, batch.kernels), self.k_norm(k, batch.kernels)
        q = self.rotary(q, batch.positions, batch.kernels)    # [T, H, D]
        k = self.rotary(k, batch.positions, batch.kernels)    # [T, Hkv, D]
        v = v.reshape(T, self.hkv, self.d)
        batch.kernels.write_kv(k_cache, v_cache, batch.out_slots, k, v)
        if batch.decode_part is not None:
            P = batch.prefill_part.input_ids.shape[0]
            o = torch.cat([self._attend(q[:P], batch.prefill_part, k_cache, v_cache),
                           self._attend(q[P:], batch.decode_part, k_cache, v_cache)])
        else:
            o = self._attend(q, batch, k_cache, v_cache)
        o = o.reshape(T, self.h * self.d)
        if self.gated:
            o = o * torch.sigmoid(gate)
        out = batch.kernels.linear(o, self.o.weight)
        return out if self.o.bias is None else out.add_(self.o.bias)

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        ops = batch.kernels
        if self.window and batch.is_decode:
            # a decode row's keys are its last `window` slots: the kernels read a clipped table
            table, lens = batch.windowed(self.window)
            return ops.decode_attention(q, k_cache, v_cache, table, lens, self.scale)
        if self.window:     # the runner forms no cascade groups for a windowed model
            return ops.extend_attention(q, k_cache, v_cache, batch.bounds(), batch.seq_slots, batch.prefix_lens,
                                        self.scale, window=self.window)
        if batch.groups and batch.is_decode:
            return ops.cascade_decode(q, k_cache, v_cache, batch.own_table, batch.own_lens, batch.groups, self.scale)
        if batch.groups:
            return ops.cascade_prefill(q, k_cache, v_cache, batch.bounds(), batch.seq_slots, batch.prefix_lens,
                                       batch.groups, self.scale)
        if batch.is_decode:
            return ops.decode_attention(q, k_cache, v_cache, batch.slot_table, batch.seq_lens, self.scale)
        return ops.extend_attention(q, k_cache, v_cache, batch.bounds(), batch.seq_slots, batch.prefix_lens, self.scale)
