"""The gated delta rule's decode and prefill ops by the CPU kernel (cpu_decode.cpp, built by
kernels.cpu_ext), with the signatures of their torch references (naive.py, packed.py), which serve
until the kernel is built, and for what it does not take (a state pool that is not fp32 and
contiguous)."""
from __future__ import annotations

import torch

from .. import cpu_ext
from ..packing import depth_rows, prefill_rows, spans
from . import naive, packed


def gated_delta_rule_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                  use_qk_l2norm: bool = True) -> torch.Tensor:
    """naive.gated_delta_rule_decode_slots."""
    ext = cpu_ext.get()
    if ext is None or not _takes(pool):
        return naive.gated_delta_rule_decode_slots(q, k, v, g, beta, pool, slots, use_qk_l2norm)
    return _run(ext, q, k, v, g, beta, pool, slots, [q.shape[0]], use_qk_l2norm, keep=False)[0]


def gated_delta_rule_decode_depths_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                         beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                         counts: list[int], use_qk_l2norm: bool = True,
                                         keep: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """naive.gated_delta_rule_decode_depths_slots."""
    ext = cpu_ext.get()
    if ext is None or not _takes(pool):
        return naive.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, pool, slots, counts, use_qk_l2norm, keep)
    return _run(ext, q, k, v, g, beta, pool, slots, counts, use_qk_l2norm, keep)


def gated_delta_rule_prefill_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, o: torch.Tensor, pool: torch.Tensor,
                                   bounds: list[tuple[int, int]], slots: list[int],
                                   taps: list[list[tuple[int, int]]]) -> None:
    """packed.gated_delta_rule_prefill_slots."""
    ext = cpu_ext.get()
    if ext is None or not _takes(pool) or not bounds:
        return packed.gated_delta_rule_prefill_slots(q, k, v, g, beta, o, pool, bounds, slots, taps)
    # q, k, v and o in the model's dtype (fp32 or bf16), the conv output's per-head views as they
    # are: the kernel normalizes, scales and maps the qk heads to the value heads itself
    q, k, v = _direct(q, k, v)
    direct = o.dtype == q.dtype and o.is_contiguous()
    out = o if direct else torch.empty(o.shape, dtype=q.dtype)
    ext.gdr_prefill(q, k, v, g.float().contiguous(), beta.float().contiguous(), out, pool,
                    *prefill_rows(bounds, slots, taps, pool.device), True, q.shape[-1] ** -0.5)
    if not direct:
        for s, e in spans(bounds, o.shape[0]):       # the sequences' rows only
            o[s:e] = out[s:e]


def _takes(pool: torch.Tensor) -> bool:
    return pool.device.type == "cpu" and pool.dtype == torch.float32 and pool.is_contiguous()


def _run(ext, q, k, v, g, beta, pool, slots, counts, use_qk_l2norm, keep):
    out_dtype = q.dtype
    q, k, v = _direct(q, k, v)
    offsets, lens, soff, kept = depth_rows(tuple(counts), pool.device)
    o = torch.empty(v.shape, dtype=v.dtype)
    saved = pool.new_empty(kept if keep else 0, *pool.shape[1:])
    ext.gdr_decode_depths(q, k, v, g.float().contiguous(), beta.float().contiguous(), pool, slots.contiguous(),
                          offsets, lens, o, saved, soff, use_qk_l2norm, q.shape[-1] ** -0.5)
    # saved holds depth 0's kept states, then depth 1's, ...: saved[d] has counts[d + 1] of them
    return o.to(out_dtype), list(saved.split(counts[1:])) if keep else []


def _direct(q, k, v):
    """q, k, v as the kernel reads them: the layer's views as they are when in one dtype the kernel
    takes (fp32, bf16) with unit-stride heads, else fp32 copies."""
    dt = q.dtype
    if dt in (torch.float32, torch.bfloat16) and k.dtype == dt and v.dtype == dt \
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        return q, k, v
    return q.float().contiguous(), k.float().contiguous(), v.float().contiguous()
