"""The causal short convolution over a packed prefill batch whose states live in a pool: the
reference the executor calls (kernels.dispatch), built from causal_conv1d_padded. Taps as in
gated_delta_rule.packed: (n, dst) copies the conv state after the first n tokens to slot dst."""
from __future__ import annotations

import torch

from ..packing import gather_rows, padded_rows, similar
from .naive import causal_conv1d_padded

__all__ = ["causal_conv1d_prefill_slots"]


def causal_conv1d_prefill_slots(x: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor,
                                bounds: list[tuple[int, int]], slots: list[int],
                                taps: list[list[tuple[int, int]]], activation: str | None = "silu") -> None:
    """Sequences of a packed batch through the conv.

    Args:
        x, out: [T, C]; out written at each sequence's rows
        pool: [P, C, W-1], read at slots[i] and written there, and at the taps' slots
        weight: [C, W]
        bounds, slots, taps: as gated_delta_rule_prefill_slots

    Similar lengths share one padded call; else each sequence is a padded batch of one.
    """
    lens = [e - s for s, e in bounds]
    groups = [list(range(len(bounds)))] if similar(lens) else [[i] for i in range(len(bounds))]
    Wm1 = pool.shape[-1]
    for grp in groups:
        rows, real = padded_rows([bounds[i] for i in grp], x.shape[0], x.device)
        # a padding row is any row: the conv is causal, and the states are taken at each sequence's end
        xp = gather_rows(x, rows.clamp(max=x.shape[0] - 1)).transpose(1, 2)                 # [B, C, L]
        sl = torch.tensor([slots[i] for i in grp], device=pool.device)
        y, final, xx = causal_conv1d_padded(xp, weight, pool[sl], torch.tensor([lens[i] for i in grp], device=x.device),
                                            activation)
        out[rows[real]] = y.transpose(1, 2)[real]
        for b, i in enumerate(grp):
            for n, dst in taps[i]:       # the state after n tokens: the W-1 inputs before token n
                pool[dst] = xx[b, :, n:n + Wm1]
        pool[sl] = final
