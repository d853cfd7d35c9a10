"""The causal conv1d decode updates by the CPU kernel (cpu_update.cpp, built by kernels.cpu_ext),
with the signatures of their torch references in naive.py, which serve until the kernel is built,
and for what it does not take (a state pool that is not fp32 and contiguous, another activation)."""
from __future__ import annotations

import torch

from .. import cpu_ext
from ..packing import depth_rows
from . import naive


def causal_conv1d_update_slots(x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                               activation: str | None = "silu") -> torch.Tensor:
    """naive.causal_conv1d_update_slots."""
    ext = cpu_ext.get()
    if ext is None or not _takes(pool, activation):
        return naive.causal_conv1d_update_slots(x, pool, weight, slots, activation)
    return _run(ext, x, pool, weight, slots, [x.shape[0]], activation, keep=False)[0]


def causal_conv1d_update_depths_slots(x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                                      counts: list[int], activation: str | None = "silu"
                                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """naive.causal_conv1d_update_depths_slots."""
    ext = cpu_ext.get()
    if ext is None or not _takes(pool, activation):
        return naive.causal_conv1d_update_depths_slots(x, pool, weight, slots, counts, activation)
    return _run(ext, x, pool, weight, slots, counts, activation, keep=True)


def _takes(pool: torch.Tensor, activation: str | None) -> bool:
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and pool.is_contiguous() \
        and activation in (None, "silu", "swish")


def _run(ext, x, pool, weight, slots, counts, activation, keep):
    offsets, lens, soff, kept = depth_rows(tuple(counts), pool.device)
    y = torch.empty(x.shape, dtype=torch.float32)
    saved = pool.new_empty(kept if keep else 0, *pool.shape[1:])
    ext.conv_update_depths(x.float().contiguous(), pool, weight.float().contiguous(), slots.contiguous(), offsets,
                           lens, y, saved, soff, activation is not None)
    parts = []
    if keep:
        s = 0
        for n in counts[1:]:
            parts.append(saved[s:s + n])
            s += n
    return y.to(x.dtype), parts
