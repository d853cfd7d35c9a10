"""A grammar's token bitmask applied to CPU logits, in torch ops: the reference of cpu_apply.cpp
(cpu.py has the same signature), the same as xgrammar's apply_token_bitmask_inplace
(tests/test_backends.py checks both against it)."""
from __future__ import annotations

import torch

BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], mask_rows: list[int] | None = None) -> None:
    """logits[r, t] = -inf where bit t of bitmask[r] is clear, for r in rows (CPU, in place; with
    mask_rows, row rows[j] reads bitmask row mask_rows[j]). Faster than xgrammar's CPU kernel on
    JSON masks. Those allow few tokens in most states: nearly every 32-token word of a row is 0,
    and xgrammar's CPU kernel still tests every bit. So a row is filled with -inf as a whole,
    and only the words with some bit set are gathered before and written back after, bit by bit.
    logits [R, V] float; bitmask [B, W] int32, W >= ceil(V / 32)."""
    V = logits.shape[-1]
    full = V // 32 * 32
    sel = torch.tensor(rows, dtype=torch.int64)
    every = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    x = logits if every else logits[sel]
    bm = bitmask[sel if mask_rows is None else torch.tensor(mask_rows, dtype=torch.int64)]
    if full < V:     # the last, partial word: bit by bit
        tail = ((bm[:, full // 32: full // 32 + 1] >> BITS[: V - full]) & 1) == 0
        x[:, full:].masked_fill_(tail, float("-inf"))
    blocks = x[:, :full].view(len(rows), full // 32, 32)
    r, w = (bm[:, : full // 32] != 0).nonzero(as_tuple=True)
    kept = blocks[r, w]                                            # [K, 32]
    blocks.fill_(float("-inf"))
    allowed = ((bm[r, w].unsqueeze(-1) >> BITS) & 1) != 0
    blocks[r, w] = torch.where(allowed, kept, float("-inf"))
    if not every:
        logits[sel] = x
