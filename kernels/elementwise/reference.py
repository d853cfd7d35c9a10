"""The torch forms of the layers' elementwise ops, in the model's dtype: fp32 by torch's fused ops;
bf16 (and others) computed in fp32 and cast where transformers casts, so that a bf16 model matches
its reference. The contract of each op is its docstring here; cpu.py has the same signatures."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """x / rms(x) * w over the last dim, in fp32. Zero-centered (Qwen3.5): w = 1 + weight, the product
    cast once; else (Qwen3) the normalized x is cast to the dtype before the weight scales it.
    x [..., D] (any strides); returns a new contiguous tensor in x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, 1.0 + weight if zero_centered else weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x * (1.0 + weight.float())).to(dtype)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's step of a pre-norm block: x += r in place (in x's dtype, as x + r), then
    rms_norm of the sum. x, r [..., D] of one shape; returns (x, the norm)."""
    x += r
    return x, rms_norm(x, weight, eps, zero_centered)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: h [T, 2I] = [gate | up] -> silu(gate) * up [T, I], in h's dtype."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * silu(z) (a DeltaNet head's output norm): x, z [T, H, D] (z any
    strides); in x's dtype, the weighted norm cast to it before the gate (as transformers)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps) * F.silu(z)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x = weight * x.to(dtype)
    return (x * F.silu(z.float())).to(dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) on the first R dims of each head, the rest kept:
    x [T, H, D] (any row strides), cos and sin [T, 1, R] in x's dtype; each product and the sum in
    x's dtype, as transformers computes it. Returns a new contiguous tensor."""
    r = cos.shape[-1]
    rot, keep = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos + rotated * sin, keep], dim=-1)
