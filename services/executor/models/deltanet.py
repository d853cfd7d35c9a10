"""Gated DeltaNet layer (Qwen3.5 / Qwen3-Next linear attention) over the state-slot pool.

Per token: a depthwise causal conv (kernel W) over [q|k|v] with SiLU, then the gated delta rule
    S <- S * exp(g);  S <- S + k (beta * (v - k^T S))^T;  o = q^T S
with q, k L2-normalised, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), and a gated
RMSNorm on the output. The conv keeps the last W-1 inputs and the rule keeps S: both live in the
sequence's state slot, read at the start of a step and written back at its end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..forward_batch import ForwardBatch
from .layers import GatedRMSNorm
from .spec import ModelSpec


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.hk, self.hv = spec.lin_num_k_heads, spec.lin_num_v_heads
        self.dk, self.dv = spec.lin_k_dim, spec.lin_v_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = spec.conv_dim
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a fused into one matmul by the loader
        self.in_proj = nn.Linear(spec.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, spec.conv_kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, spec.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rec: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        mixed, z, b, a = batch.kernels.linear(x, self.in_proj.weight).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        slots = batch.state_slots
        saved = None
        if batch.depth_bounds is not None:
            saved = ([], [])
            batch.saved.append(saved)
            mixed = self._conv_by_depth(mixed, batch, conv, saved[0])
        elif batch.is_decode:
            mixed = batch.kernels.causal_conv1d_update_slots(mixed, conv, self.conv_weight, slots)
        else:
            out = torch.empty_like(mixed)
            ones, rows, rest = batch.single_rows()
            if ones:   # one-token sequences (a mixed step's decode rows): batched, as in a decode step
                out[rows] = batch.kernels.causal_conv1d_update_slots(mixed[rows], conv, self.conv_weight, slots[ones])
            if rest:
                batch.kernels.causal_conv1d_prefill_slots(mixed, out, conv, self.conv_weight, *batch.prefill_pieces())
            mixed = out
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.hk, self.dk)
        k = k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)   # [T, Hv], <= 0
        if saved is not None:
            o = self._rule_by_depth(q, k, v, g, beta, batch, rec, saved[1])
        elif batch.is_decode:
            o = batch.kernels.gated_delta_rule_decode_slots(q, k, v, g, beta, rec, slots)
        else:
            o = torch.empty_like(v)
            ones, rows, rest = batch.single_rows()
            if ones:
                o[rows] = batch.kernels.gated_delta_rule_decode_slots(q[rows], k[rows], v[rows], g[rows], beta[rows], rec,
                                                                        slots[ones])
            if rest:
                batch.kernels.gated_delta_rule_prefill_slots(q, k, v, g, beta, o, rec, *batch.prefill_pieces())
        o = self.norm(o, z.reshape(T, self.hv, self.dv), batch.kernels)
        return batch.kernels.linear(o.reshape(T, self.value_dim), self.out_proj.weight)

    # A decode step with jump-forward drafts has several rows per sequence, one per position, all
    # on the sequence's one state slot: they run depth by depth. Depth 0 holds every sequence's row,
    # longest draft first, so the sequences still running at depth d are the first n_d of them (the
    # kernels' `counts`): the states are gathered from the pool once and written back once. The
    # state after each depth but the last is kept in `saved` so that a rejected draft tail can be
    # undone (verify.py: state_after).

    def _conv_by_depth(self, mixed: torch.Tensor, batch: ForwardBatch, conv: torch.Tensor, saved: list) -> torch.Tensor:
        counts = [e - s for s, e in batch.depth_bounds]
        out, kept = batch.kernels.causal_conv1d_update_depths_slots(mixed, conv, self.conv_weight,
                                                                    batch.state_slots[: counts[0]], counts)
        saved.extend(kept)
        return out

    def _rule_by_depth(self, q, k, v, g, beta, batch: ForwardBatch, rec: torch.Tensor, saved: list) -> torch.Tensor:
        counts = [e - s for s, e in batch.depth_bounds]
        o, kept = batch.kernels.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, rec, batch.state_slots[: counts[0]],
                                                                     counts, keep=batch.keep_states)
        saved.extend(kept)
        return o
