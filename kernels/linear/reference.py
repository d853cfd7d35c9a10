"""Linear layers as the model runs them; the contract of the kernels beside them (cpu.py).

`weight` is an nn.Linear's weight ([N, K], no bias: the models' projections have none)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..elementwise import reference as _ew


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] . weight^T -> [..., N], in x's dtype (torch's matmul: fp32 accumulation, one rounding)."""
    return F.linear(x, weight)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, silu_mul=_ew.silu_mul) -> torch.Tensor:
    """The SwiGLU MLP's first half: silu_mul(linear(x, weight)), weight = [gate; up] ([2I, K]) -> [T, I].
    `silu_mul`: the runner's (its kernels may fuse it)."""
    return silu_mul(linear(x, weight))
