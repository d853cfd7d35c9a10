"""Attention by the CPU kernels (built by kernels.cpu_ext), with the signatures of the torch forms,
which serve until the kernels are built and for what they do not take (another device or dtype, q
and pool in two dtypes):
- decode (cpu_decode.cpp): naive.decode_attention, cascade.cascade_decode's own parts;
- many query rows over one K/V, bf16 or fp32 (cpu_prefill.cpp): cascade.attend_lse, which extend_attention,
  cascade_prefill and the shared part of cascade_decode take (torch's flash-attention op for the rest)."""
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


def _attend_ext(q: torch.Tensor, k: torch.Tensor):
    """The built module where the prefill kernel takes these (head size 64, 128 or 256; bf16 on a CPU
    with AVX512-BF16, fp32 on one with AVX-512), else None."""
    ext = cpu_ext.get()
    if ext is None or not (q.device.type == "cpu" and q.dtype == k.dtype and q.shape[-1] in (64, 128, 256)):
        return None
    takes = ext.attend_takes_bf16() if q.dtype == torch.bfloat16 else q.dtype == torch.float32 and ext.attend_takes_fp32()
    return ext if takes else None


_EMPTY = torch.empty(0, dtype=torch.int64)


def attend_lse(q, k, v, scale: float, q_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cascade.attend_lse."""
    ext = _attend_ext(q, k)
    if ext is None or v.dtype != q.dtype or k.shape[0] == 0:
        return cascade.attend_lse(q, k, v, scale, q_pos)
    return _attend(ext, q, k, v, scale, q_pos, _EMPTY)


def attend_at(q, k_cache, v_cache, slots: torch.Tensor, scale: float,
              q_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cascade.attend_at: the keys read by the kernel where they lie in the pool, not gathered first
    (a prefix not contiguous in the pool would otherwise be copied at every decode step)."""
    ext = _attend_ext(q, k_cache)
    if ext is None or v_cache.dtype != q.dtype or len(slots) == 0 or slots.device.type != "cpu":
        return cascade.attend_at(q, k_cache, v_cache, slots, scale, q_pos, attend=attend_lse)
    return _attend(ext, q, k_cache, v_cache, scale, q_pos, slots.to(torch.int64).contiguous())


def _attend(ext, q, k, v, scale: float, q_pos, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    pos = _EMPTY if q_pos is None else q_pos.to(torch.int64).contiguous()
    ext.attend_prefill(q if q.stride(2) == 1 else q.contiguous(), k if k.stride(2) == 1 else k.contiguous(),
                       v if v.stride(2) == 1 else v.contiguous(), pos, slots, float(scale), o, lse)
    return o, lse


def extend_attention(q, k_cache, v_cache, bounds, seq_slots, prefix_lens, scale: float, window: int = 0) -> torch.Tensor:
    """naive.extend_attention: each sequence's new tokens over its slots, read in place by attend_at
    above (where the kernel does not take them, naive's, whose fresh prompts need no mask). Under a
    sliding window the kernel takes a sequence whose new tokens all see the same keys (one token,
    or a context within the window); naive's window mask the rest."""
    if _attend_ext(q, k_cache) is None or v_cache.dtype != q.dtype:
        return naive.extend_attention(q, k_cache, v_cache, bounds, seq_slots, prefix_lens, scale, window)
    o = torch.empty_like(q)
    for (s, e), slots, p in zip(bounds, seq_slots, prefix_lens):
        if len(slots) != p + e - s:
            raise ValueError(f"len(slots)={len(slots)} != prefix_len + E = {p} + {e - s}")
        lo = max(0, p - window + 1) if window else 0
        if window and e - s > 1 and p + e - s - lo > window:
            o[s:e] = naive.prefill_attention(q[s:e], k_cache, v_cache, slots, p, scale, window)
            continue
        o[s:e] = attend_at(q[s:e], k_cache, v_cache, slots[lo:], scale, torch.arange(p - lo, p - lo + e - s))[0]
    return o


def attend_group(q, k_cache, v_cache, g: cascade.SharedPrefix, bounds, seq_slots, prefix_lens, scale: float,
                 out: torch.Tensor) -> None:
    """cascade_prefill's `attend_group` by the fp32 kernel (attend_cascade): a group's rows over its
    shared prefix and then each member's own keys in one online softmax, written into out's rows:
    one pass instead of the composition (shared part, own parts padded through torch's op, merge,
    the copies between)."""
    S = len(g.slots)
    own = [seq_slots[i][S:].to(torch.int64) for i in g.seqs]
    own_off = torch.zeros(len(own) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor([len(x) for x in own], dtype=torch.int64), 0, out=own_off[1:])
    cpu_ext.get().attend_cascade(
        q if q.stride(2) == 1 else q.contiguous(), k_cache, v_cache, g.slots.to(torch.int64).contiguous(),
        torch.tensor([bounds[i] for i in g.seqs], dtype=torch.int64), torch.cat(own), own_off,
        torch.tensor([prefix_lens[i] - S for i in g.seqs], dtype=torch.int64), float(scale), out,
        torch.empty(q.shape[:2], dtype=torch.float32))


def cascade_prefill(q, k_cache, v_cache, bounds, seq_slots, prefix_lens, groups, scale: float) -> torch.Tensor:
    """cascade.cascade_prefill with attend_lse and attend_at above, and in fp32 attend_group."""
    fused = q.dtype == torch.float32 and v_cache.dtype == q.dtype and _attend_ext(q, k_cache) is not None \
        and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    return cascade.cascade_prefill(q, k_cache, v_cache, bounds, seq_slots, prefix_lens, groups, scale, attend=attend_lse,
                                   attend_in_place=attend_at, attend_group=attend_group if fused else None)


# A group of this many rows or fewer has its shared prefix read in place by the decode kernel, row
# by row: attend_lse packs the prefix's K and V first, which for a few rows costs more than reading
# them. A group of one is what a lone long sequence decodes as (runner.shared_prefixes).
FEW_ROWS = 4


def cascade_decode(q, k_cache, v_cache, own_table, own_lens, groups, scale: float) -> torch.Tensor:
    """cascade.cascade_decode: the own parts by the decode kernel, each group's shared prefix read
    once for the group's rows (attend_lse above; a group of FEW_ROWS or fewer by the decode kernel),
    merged by their log-sum-exp."""
    ext = cpu_ext.get()
    if ext is None or not _takes(q, k_cache, v_cache):
        return cascade.cascade_decode(q, k_cache, v_cache, own_table, own_lens, groups, scale)
    o, lse = _rows(ext, q, k_cache, v_cache, own_table, own_lens, scale)
    many = []
    for g in groups:
        if len(g.seqs) > FEW_ROWS:
            many.append(g)
            continue
        rows, n, S = torch.tensor(g.seqs, device=q.device), len(g.seqs), len(g.slots)
        o_s, lse_s = _rows(ext, q[rows], k_cache, v_cache, g.slots[None].expand(n, S),
                           torch.full((n,), S, dtype=torch.int64), scale)
        o[rows] = cascade.merge(o[rows], lse[rows], o_s, lse_s)
    return cascade.with_shared(q, k_cache, v_cache, many, scale, o, lse, attend=attend_lse, attend_in_place=attend_at)
