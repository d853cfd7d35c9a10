"""Packed batches: sequence i owns the rows bounds[i] = (start, end) of every [T, ...] tensor. The
torch references batch sequences of similar lengths into one right-padded call; these say how."""
from __future__ import annotations

import functools

import torch

# sequences share one padded call while the padding stays under this share of their tokens (else
# each runs alone)
PAD_WASTE = 1.25


def similar(lens: list[int]) -> bool:
    """Whether sequences of these lengths go into one padded call."""
    return len(lens) > 1 and max(lens) * len(lens) <= PAD_WASTE * sum(lens)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] (idx of any shape) by index_select: on a CPU several times faster than advanced
    indexing."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def padded_rows(bounds: list[tuple[int, int]], T: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L] packed row of (sequence b, position t), or T (to be an appended row of zeros) past the
    sequence's end; and the mask of real rows."""
    L = max(e - s for s, e in bounds)
    idx = torch.full((len(bounds), L), T, dtype=torch.int64, device=dev)
    for b, (s, e) in enumerate(bounds):
        idx[b, : e - s] = torch.arange(s, e, device=dev)
    return idx, idx < T


def depth_layout(counts: list[int], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step with drafts, rows depth-major (depth d's counts[d] rows belong to sequences
    0 .. counts[d]-1): each depth's first row [D] and each sequence's number of depths [counts[0]],
    int32 on `dev`, for the depth kernels to find row (d, i) = offsets[d] + i."""
    offsets = torch.tensor([0] + counts[:-1], device=dev).cumsum(0).to(torch.int32)
    depths = torch.tensor([sum(1 for c in counts if c > i) for i in range(counts[0])], dtype=torch.int32, device=dev)
    return offsets, depths


@functools.lru_cache(maxsize=512)
def depth_rows(counts: tuple[int, ...], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For the CPU depth kernels (rows depth-major, as in depth_layout): each depth's first row [D],
    each sequence's number of depths [N], int64; where the state of sequence i after depth d goes
    among the kept ones ([D]: row soff[d] + i, for i < counts[d+1]) and how many are kept. The same
    few draft shapes recur step after step and every DeltaNet layer asks, so they are built once
    per shape (read-only)."""
    offsets, soff, s, k = [], [], 0, 0
    for d, n in enumerate(counts):
        offsets.append(s)
        soff.append(k)
        s += n
        k += counts[d + 1] if d + 1 < len(counts) else 0
    lens = [sum(1 for c in counts if c > i) for i in range(counts[0])]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)      # noqa: E731
    return t(offsets), t(lens), t(soff), k


def prefill_rows(bounds: list[tuple[int, int]], slots: list[int], taps: list[list[tuple[int, int]]],
                 dev: torch.device) -> tuple[torch.Tensor, ...]:
    """For the CPU prefill kernels: each sequence's first and end rows and its slot [N], and its
    taps flattened (sequence n's are tap_at / tap_dst [tap_lo[n], tap_lo[n + 1])), int64."""
    lo, at, dst = [0], [], []
    for cuts in taps:
        for n, d in cuts:
            at.append(n)
            dst.append(d)
        lo.append(len(at))
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)      # noqa: E731
    return t([s for s, _ in bounds]), t([e for _, e in bounds]), t(slots), t(lo), t(at), t(dst)


def spans(bounds: list[tuple[int, int]], T: int) -> list[tuple[int, int]]:
    """The row ranges a packed prefill's sequences cover: one range when they cover all T rows,
    else theirs (the rows between are a mixed step's decode rows, the caller's)."""
    return [(0, T)] if sum(e - s for s, e in bounds) == T else list(bounds)
