"""Linear layers by the CPU kernel (cpu_gemm.cpp, built by kernels.cpu_ext), with the signatures of
reference.py, which serves until the kernel is built and for what it does not take: fp32 on a CPU
without AVX-512; bf16 on a CPU without AVX512-BF16 or with AMX (where oneDNN's tile kernels are
faster), or with an odd K; other dtypes. The MLP's gate/up product takes SiLU-and-multiply in the same
pass (its [T, 2I] product is never written).

Each weight is packed for the kernel the first time it is used, and the packed copy is kept on the
weight tensor itself (so it lives and dies with the model, and a weight written in place, whose
version changes, is packed again). It costs as much memory again as the weights it packs."""
from __future__ import annotations

import torch

from .. import cpu_ext
from ..elementwise import cpu as _ew
from . import reference


def _ext(x: torch.Tensor, weight: torch.Tensor):
    """The built module where the kernel takes these, else None."""
    ext = cpu_ext.get()
    # `is_cpu`, not a device object: this runs four or five times a layer in a decode step
    if ext is None or not (x.is_cpu and weight.is_cpu and x.dtype == weight.dtype and weight.ndim == 2
                           and x.shape[-1] == weight.shape[1] and weight.is_contiguous()):
        return None
    if x.dtype == torch.float32:
        return ext if ext.linear_takes_fp32() else None
    if x.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and ext.linear_takes_bf16() \
            and not (weight.shape[1] > BF16_LONG_K and x.numel() // weight.shape[1] > BF16_LONG_K_ROWS):
        return ext
    return None


# bf16 products over K past this, for more rows than BF16_LONG_K_ROWS, go to oneDNN: the kernel does not
# block K, and a weight block of K x 64 past L2 falls behind oneDNN there. fp32 streams well at every K.
BF16_LONG_K = 8192
BF16_LONG_K_ROWS = 256


def _packed(ext, weight: torch.Tensor, halves: int) -> torch.Tensor:
    return cpu_ext.kept_on(weight, "_rf_packed", halves, lambda: ext.linear_pack(weight.detach(), halves))


def _run(ext, x: torch.Tensor, weight: torch.Tensor, n_out: int, silu: bool) -> torch.Tensor:
    flat = x.ndim == 2               # the model's activations: no reshapes in or out
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.shape[0] and rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n_out, dtype=x.dtype)
    if rows.shape[0]:
        ext.linear_packed(rows, _packed(ext, weight, n_out if silu else 0), n_out, silu, out)
    return out if flat else out.reshape(*x.shape[:-1], n_out)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """reference.linear."""
    ext = _ext(x, weight)
    if ext is None:
        return reference.linear(x, weight)
    return _run(ext, x, weight, weight.shape[0], False)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """reference.linear_silu_mul, in one pass where the kernel takes it (else the fused elementwise op
    after torch's matmul)."""
    ext = _ext(x, weight)
    if ext is None or x.dim() != 2 or weight.shape[0] % 2:
        return reference.linear_silu_mul(x, weight, _ew.silu_mul)
    return _run(ext, x, weight, weight.shape[0] // 2, True)
