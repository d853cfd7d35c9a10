"""Packed batches: sequence i owns the rows bounds[i] = (start, end) of every [T, ...] tensor. The
torch references batch sequences of similar lengths into one right-padded call; these say how."""
from __future__ import annotations

import torch

# sequences share one padded call while the padding stays under this share of their tokens (else
# each runs alone)
PAD_WASTE = 1.25


def similar(lens: list[int]) -> bool:
    """Whether sequences of these lengths go into one padded call."""
    return len(lens) > 1 and max(lens) * len(lens) <= PAD_WASTE * sum(lens)


def padded_rows(bounds: list[tuple[int, int]], T: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] packed row of (sequence b, position t), or T (to be an appended row of zeros) past the
    sequence's end; and the mask of real rows."""
    L = max(e - s for s, e in bounds)
    idx = torch.full((len(bounds), L), T, dtype=torch.int64, device=dev)
    for b, (s, e) in enumerate(bounds):
        idx[b, : e - s] = torch.arange(s, e, device=dev)
    return idx, idx < T
