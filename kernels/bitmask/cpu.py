"""The token bitmask applied by the CPU kernel (cpu_apply.cpp, built by kernels.cpu_ext), where it
takes the tensors: fp32 logits and int32 bitmask rows, contiguous, on the CPU."""
from __future__ import annotations

import torch

from .. import cpu_ext


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], mask_rows: list[int] | None) -> bool:
    """constrain.apply_bitmask's contract; False (nothing done) where the kernel is not built yet or
    does not take these tensors: the caller's torch form then serves."""
    ext = cpu_ext.get()
    if ext is None or not (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
                           and bitmask.dtype == torch.int32 and bitmask.is_contiguous() and logits.dim() == 2):
        return False
    ext.apply_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64),
                      torch.tensor(rows if mask_rows is None else mask_rows, dtype=torch.int64))
    return True
