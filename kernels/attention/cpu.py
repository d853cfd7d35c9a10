"""Decode attention by the CPU kernel (cpu_decode.cpp, built by kernels.cpu_ext), with the
signatures of the torch forms (naive.decode_attention, cascade.cascade_decode), which serve until the
kernel is built and for what it does not take (another device or dtype, q and pool in two dtypes).
Prefill attention stays torch's flash-attention op: there the FLOPs are many and the op is fast."""
from __future__ import annotations

import torch

from .. import cpu_ext
from . import cascade, naive

_DTYPES = (torch.float32, torch.bfloat16)


def _takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype \
        and k_cache.is_contiguous() and v_cache.is_contiguous() and q.shape[1] % k_cache.shape[1] == 0


def _rows(ext, q, k_cache, v_cache, table, lens, scale) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    ext.decode_rows(q.contiguous(), k_cache, v_cache, table.to(torch.int64).contiguous(),
                    lens.to(torch.int64).contiguous(), float(scale), o, lse)
    return o, lse


def decode_attention(q, k_cache, v_cache, slot_table, seq_lens, scale: float) -> torch.Tensor:
    """naive.decode_attention."""
    ext = cpu_ext.get()
    if ext is None or not _takes(q, k_cache, v_cache):
        return naive.decode_attention(q, k_cache, v_cache, slot_table, seq_lens, scale)
    return _rows(ext, q, k_cache, v_cache, slot_table, seq_lens, scale)[0].to(q.dtype)


def cascade_decode(q, k_cache, v_cache, own_table, own_lens, groups, scale: float) -> torch.Tensor:
    """cascade.cascade_decode: the own parts by the kernel, each group's shared prefix as there
    (one flash-attention call over it for the group's rows), merged by their log-sum-exp."""
    ext = cpu_ext.get()
    if ext is None or not _takes(q, k_cache, v_cache):
        return cascade.cascade_decode(q, k_cache, v_cache, own_table, own_lens, groups, scale)
    o, lse = _rows(ext, q, k_cache, v_cache, own_table, own_lens, scale)
    return cascade.with_shared(q, k_cache, v_cache, groups, scale, o, lse)
