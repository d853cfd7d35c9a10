"""The causal conv1d decode updates and prefill by the CPU kernel (cpu_update.cpp, built by
kernels.cpu_ext), with the signatures of their torch references (naive.py, packed.py), which serve
until the kernel is built, and for what it does not take (a state pool that is not fp32 and
contiguous, another activation)."""
from __future__ import annotations

import torch

from .. import cpu_ext
from ..packing import depth_rows, prefill_rows, spans
from . import naive, packed


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


def causal_conv1d_prefill_slots(x: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor,
                                bounds: list[tuple[int, int]], slots: list[int],
                                taps: list[list[tuple[int, int]]], activation: str | None = "silu") -> None:
    """packed.causal_conv1d_prefill_slots."""
    ext = cpu_ext.get()
    if ext is None or not _takes(pool, activation) or not bounds:
        return packed.causal_conv1d_prefill_slots(x, out, pool, weight, bounds, slots, taps, activation)
    # x and out in the model's dtype (fp32 or bf16) are read and written by the kernel as they are,
    # the SiLU fused; anything else through an fp32 copy
    direct = out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous()
    y = out if direct else torch.empty(out.shape, dtype=torch.float32)
    xin = x if x.dtype == y.dtype and x.stride(-1) == 1 else x.to(y.dtype).contiguous()   # a split: its rows as they lie
    ext.conv_prefill(xin, y, pool, weight.float().contiguous(),
                     *prefill_rows(bounds, slots, taps, pool.device), activation is not None)
    if not direct:
        # the copy out over the sequences' rows only: the others (a mixed step's decode rows) are
        # the caller's, already written
        for s, e in spans(bounds, out.shape[0]):
            out[s:e] = y[s:e]


def _takes(pool: torch.Tensor, activation: str | None) -> bool:
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and pool.is_contiguous() \
        and activation in (None, "silu", "swish")


def _run(ext, x, pool, weight, slots, counts, activation, keep):
    offsets, lens, soff, kept = depth_rows(tuple(counts), pool.device)
    y = torch.empty(x.shape, dtype=torch.float32)
    saved = pool.new_empty(kept if keep else 0, *pool.shape[1:])
    xin = x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()
    ext.conv_update_depths(xin, pool, weight.float().contiguous(), slots.contiguous(), offsets,
                           lens, y, saved, soff, activation is not None)
    # saved holds depth 0's kept states, then depth 1's, ...: saved[d] has counts[d + 1] of them
    return y.to(x.dtype), list(saved.split(counts[1:])) if keep else []
