"""The fused elementwise ops by the CPU kernel (cpu_fused.cpp, built by kernels.cpu_ext), with the
signatures of reference.py, which serves until the kernel is built, and for what it does not take
(not fp32 or bf16, SiLU-and-multiply in bf16, not on the CPU, a last dim that is not contiguous)."""
from __future__ import annotations

import torch

from .. import cpu_ext
from . import reference

_DTYPES = (torch.float32, torch.bfloat16)
# These wrappers run a dozen times a layer in a decode step, where the kernels take well under a
# microsecond: the checks are written out (no generator, `is_cpu` rather than a device object) and the
# outputs made by empty_like.
_CONTIGUOUS = torch.contiguous_format


def _row_ok(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.is_cpu and t.dtype == dtype and t.ndim in (2, 3) and t.stride(-1) == 1


def _takes(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Rows the kernel reads: fp32 or bf16 on the CPU, [A, D] or [A, B, D] with the last dim
    contiguous, all of one dtype."""
    dt = x.dtype
    if dt not in _DTYPES or not _row_ok(x, dt):
        return False
    for t in others:
        if not _row_ok(t, dt):
            return False
    return True


def _weight(w: torch.Tensor, x: torch.Tensor) -> bool:
    return w.is_cpu and w.dtype in _DTYPES and w.ndim == 1 and w.shape[0] == x.shape[-1]


def _empty(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of x's shape and dtype (as torch.empty(x.shape, dtype=x.dtype), at half the cost)."""
    return torch.empty_like(x, memory_format=_CONTIGUOUS)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.ndim == 3 else x.unsqueeze(1)       # [A, B, D]: a view, any row strides


def _norm_weight(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """The fp32 factor the kernel scales by (1 + weight where zero-centered), kept on the weight
    (cpu_ext.kept_on): making it is a copy per call, and a step runs two to four norms a layer."""
    return cpu_ext.kept_on(weight, "_rf_norm", zero_centered,
                           lambda: (1.0 + weight.float() if zero_centered else weight.float()).contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """reference.rms_norm."""
    ext = cpu_ext.get()
    if ext is None or not _takes(x) or not _weight(weight, x):
        return reference.rms_norm(x, weight, eps, zero_centered)
    out = _empty(x)
    # bf16 Qwen3 casts the normalized row before scaling it (reference.rms_norm); in fp32 no cast
    # rounds, and the zero-centered form casts only the product
    ext.rms_norm(_rows(x), _norm_weight(weight, zero_centered), eps, not zero_centered and x.dtype != torch.float32,
                 _rows(out))
    return out


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm, in one pass over the rows (the sum is written into x and normalized
    while in cache: a separate add was one more pass over the stream twice a layer)."""
    ext = cpu_ext.get()
    if ext is None or not _takes(x, r) or not _weight(weight, x) or r.shape != x.shape:
        return reference.add_rms_norm(x, r, weight, eps, zero_centered)
    out = _empty(x)
    ext.add_rms_norm(_rows(x), _rows(r), _norm_weight(weight, zero_centered), eps,
                     not zero_centered and x.dtype != torch.float32, _rows(out))
    return x, out


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """reference.silu_mul."""
    ext = cpu_ext.get()
    if ext is None or not _takes(h) or h.dim() != 2 or not h.is_contiguous() \
            or h.dtype == torch.bfloat16 and not ext.silu_mul_takes_bf16():
        return reference.silu_mul(h)        # bf16 without AVX512-BF16: torch's ops (cpu_fused.cpp says why)
    out = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype)
    ext.silu_mul(h, out)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.gated_rms_norm."""
    ext = cpu_ext.get()
    if ext is None or not _takes(x, z) or not _weight(weight, x) or x.dim() != 3 or z.shape != x.shape:
        return reference.gated_rms_norm(x, z, weight, eps)
    out = _empty(x)
    ext.gated_rms_norm(x, z, weight.float().contiguous(), eps, out)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """reference.rotary."""
    ext = cpu_ext.get()
    if ext is None or not _takes(x) or x.ndim != 3 or not (cos.dtype == sin.dtype == x.dtype) \
            or not cos.is_cpu or cos.shape != (x.shape[0], 1, cos.shape[-1]) or sin.shape != cos.shape:
        return reference.rotary(x, cos, sin)
    out = _empty(x)
    ext.rotary(x, cos.reshape(cos.shape[0], -1).contiguous(), sin.reshape(sin.shape[0], -1).contiguous(), out)
    return out
