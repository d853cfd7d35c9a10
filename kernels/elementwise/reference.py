"""The torch forms of the fused elementwise ops (fp32; the layers keep their own bf16 forms, which
follow transformers' casts). The contract of each op is its docstring here; cpu.py has the same
signatures."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x / rms(x) * w over the last dim, w = 1 + weight where zero_centered (Qwen3.5), else weight.
    x [..., D] fp32 (any strides); returns a new contiguous tensor."""
    return F.rms_norm(x, weight.shape, 1.0 + weight if zero_centered else weight, eps)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: h [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x, weight) * silu(z): x, z [T, H, D] fp32 (z any strides); returns [T, H, D]."""
    return F.rms_norm(x, weight.shape, weight, eps) * F.silu(z)
