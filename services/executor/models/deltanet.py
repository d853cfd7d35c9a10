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

from radixflow.kernels.causal_conv1d import causal_conv1d_padded, causal_conv1d_update_depths
from radixflow.kernels.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_decode_depths

from ..forward_batch import ForwardBatch
from .layers import GatedRMSNorm
from .spec import ModelSpec


# sequences of a prefill share one padded chunked-rule call while the padding stays under this
# share of their tokens (else each runs alone)
PAD_WASTE = 1.25


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
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
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
            bounds = batch.bounds()
            lens = [bounds[i][1] - bounds[i][0] for i in rest]
            # similar lengths share one padded call; else each sequence is a padded batch of one
            groups = [rest] if len(rest) > 1 and max(lens) * len(rest) <= PAD_WASTE * sum(lens) else [[i] for i in rest]
            for g in groups:
                self._conv_padded(mixed, out, conv, batch, [bounds[i] for i in g], g, slots[g])
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
            self._rule_prefill(q, k, v, g, beta, o, rec, batch, slots, rest)
        o = self.norm(o, z.reshape(T, self.hv, self.dv))
        return self.out_proj(o.reshape(T, self.value_dim))

    def _conv_padded(self, mixed, out, conv, batch: ForwardBatch, bounds: list[tuple[int, int]], seqs: list[int],
                     slots: torch.Tensor) -> None:
        """Sequences' conv as one call, right-padded to the longest; each tap's conv state (the W-1
        inputs before it) is read from the padded inputs."""
        rows, real = _padded_rows(bounds, mixed.shape[0], mixed.device)
        x = torch.cat([mixed, mixed.new_zeros(1, mixed.shape[1])])[rows].transpose(1, 2)   # [B, C, L]
        lens = torch.tensor([e - s for s, e in bounds], device=mixed.device)
        y, final, xx = causal_conv1d_padded(x, self.conv_weight, conv[slots], lens)
        out[rows[real]] = y.transpose(1, 2)[real]
        Wm1 = conv.shape[-1]
        for b, i in enumerate(seqs):
            for n, dst in batch.taps.get(i, ()):
                conv[dst] = xx[b, :, n:n + Wm1]
        conv[slots] = final

    def _rule_prefill(self, q, k, v, g, beta, o, rec, batch: ForwardBatch, slots: torch.Tensor,
                      rest: list[int]) -> None:
        """The prefill sequences `rest` through the chunked rule. A sequence with taps runs in
        segments that end at them, the state copied out after each; round r runs every sequence's
        r-th segment, similar lengths in one padded call (_rule_padded)."""
        bounds, slot_list = batch.bounds(), slots.tolist()
        segs = {}
        for i in rest:
            s, e = bounds[i]
            cuts = batch.taps.get(i, [])
            ends = [s + n for n, _ in cuts] + [e]
            segs[i] = [(a, b, dst) for a, b, dst in zip([s] + ends[:-1], ends, [d for _, d in cuts] + [-1])]
        for r in range(max((len(x) for x in segs.values()), default=0)):
            items = [(i, segs[i][r]) for i in rest if r < len(segs[i])]
            lens = [b - a for _, (a, b, _) in items]
            if len(items) > 1 and max(lens) * len(items) <= PAD_WASTE * sum(lens):
                self._rule_padded(q, k, v, g, beta, o, rec, [(a, b) for _, (a, b, _) in items],
                                  slots[[i for i, _ in items]])
            else:
                for i, (a, b, _) in items:
                    slot = slot_list[i]
                    oi, final = chunk_gated_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                                                       beta[None, a:b], initial_state=rec[slot][None])
                    o[a:b] = oi[0]
                    rec[slot] = final[0]
            for i, (_, _, dst) in items:
                if dst >= 0:
                    rec[dst] = rec[slot_list[i]]

    @staticmethod
    def _rule_padded(q, k, v, g, beta, o, rec, bounds: list[tuple[int, int]], slots: torch.Tensor) -> None:
        """Several sequences' chunked rule as one batched call, each right-padded to the longest
        with tokens of k = v = beta = g = 0, which neither write nor decay the state: their final
        states are exactly those of their own tokens (agents' siblings have similar lengths)."""
        idx, real = _padded_rows(bounds, q.shape[0], q.device)
        pad = lambda x: torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx]
        ob, final = chunk_gated_delta_rule(pad(q), pad(k), pad(v), pad(g), pad(beta), initial_state=rec[slots])
        o[idx[real]] = ob[real]
        rec[slots] = final.to(rec.dtype)

    # A decode step with jump-forward drafts has several rows per sequence, one per position, all
    # on the sequence's one state slot: they run depth by depth. Depth 0 holds every sequence's row,
    # longest draft first, so the sequences still running at depth d are the first n_d of them (the
    # kernels' `counts`): the states are gathered from the pool once and written back once. The
    # state after each depth but the last is kept in `saved` so that a rejected draft tail can be
    # undone (runner.state_after).

    def _conv_by_depth(self, mixed: torch.Tensor, batch: ForwardBatch, conv: torch.Tensor, saved: list) -> torch.Tensor:
        counts = [e - s for s, e in batch.depth_bounds]
        slots = batch.state_slots[: counts[0]]
        st = conv[slots]
        out, kept = causal_conv1d_update_depths(mixed, st, self.conv_weight, counts)
        saved.extend(kept)
        conv[slots] = st
        return out

    def _rule_by_depth(self, q, k, v, g, beta, batch: ForwardBatch, rec: torch.Tensor, saved: list) -> torch.Tensor:
        counts = [e - s for s, e in batch.depth_bounds]
        slots = batch.state_slots[: counts[0]]
        st = rec[slots]
        o, kept = gated_delta_rule_decode_depths(q, k, v, g, beta, st, counts)
        saved.extend(kept)
        rec[slots] = st
        return o


def _padded_rows(bounds: list[tuple[int, int]], T: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] packed row of (sequence b, position t), or T (to be an appended row of zeros) past the
    sequence's end; and the mask of real rows."""
    L = max(e - s for s, e in bounds)
    idx = torch.full((len(bounds), L), T, dtype=torch.int64, device=dev)
    for b, (s, e) in enumerate(bounds):
        idx[b, : e - s] = torch.arange(s, e, device=dev)
    return idx, idx < T
