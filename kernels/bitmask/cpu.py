"""The token bitmask applied by the CPU kernel (cpu_apply.cpp, built by kernels.cpu_ext), with the
signature of reference.py, which serves until the kernel is built, and for what it does not take
(logits not fp32, bitmask not int32, either not contiguous or not on the CPU)."""
from __future__ import annotations

import torch

from .. import cpu_ext
from . import reference


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], mask_rows: list[int] | None = None) -> None:
    """reference.apply_bitmask."""
    ext = cpu_ext.get()
    if ext is None or not (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
                           and bitmask.dtype == torch.int32 and bitmask.is_contiguous() and logits.dim() == 2):
        return reference.apply_bitmask(logits, bitmask, rows, mask_rows)
    ext.apply_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64),
                      torch.tensor(rows if mask_rows is None else mask_rows, dtype=torch.int64))
