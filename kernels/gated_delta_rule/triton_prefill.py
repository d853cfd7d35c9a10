"""The gated delta rule over a packed prefill batch in Triton, states in the pool by slot, with
checkpoint taps (`packed.gated_delta_rule_prefill_slots`). Two kernels:

- fused recurrent (here), for batches of short sequences (all under a chunk): program (n, h, j)
  carries columns j*BLOCK_V.. of sequence n's state for head h in registers through its tokens one
  by one (the decode kernel's update, in a loop), read from the pool once and written once, plus
  once per tap (the state after the tap's first n tokens, to the tap's slot);
      grid (N, Hv, V / BLOCK_V)
- chunked (triton_chunk.py), otherwise: matrix products per chunk of 64 tokens. It leaves states
  only at a sequence's end, so a sequence with taps is cut at them and the pieces run in rounds
  (round r: every sequence's r-th piece, one launch), each tap's state copied out after its round.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting

from .triton_chunk import CHUNK, chunk_gated_delta_rule_slots
from .triton_decode import delta_step, qk_normalized

__all__ = ["gated_delta_rule_prefill_slots"]



@triton.jit
def _gdr_prefill(Q, K, V, G, BETA, O, POOL, STARTS, ENDS, SLOTS, TAP_LO, TAP_N, TAP_DST, scale,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                 stride_ot, stride_oh, stride_pp, stride_ph, stride_pk,
                 GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // GROUP
    start, end = tl.load(STARTS + i_n), tl.load(ENDS + i_n)
    tap, tap_hi = tl.load(TAP_LO + i_n), tl.load(TAP_LO + i_n + 1)
    next_n = tl.load(TAP_N + tap, mask=tap < tap_hi, other=-1)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k, m_v = o_k < DK, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    off_s = i_h * stride_ph + o_k[:, None] * stride_pk + o_v[None, :]
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    b_s = tl.load(POOL + slot * stride_pp + off_s, mask=m_s, other=0.).to(tl.float32)           # [BK, BV]
    t64 = start.to(tl.int64)                  # the token's row, for int64 addresses
    for t in range(start, end):
        b_q = tl.load(Q + t64 * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(K + t64 * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.).to(tl.float32)
        b_q, b_k = qk_normalized(b_q, b_k, scale, True)
        b_v = tl.load(V + t64 * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.).to(tl.float32)
        b_s, b_o = delta_step(b_s, b_q, b_k, b_v, tl.load(G + t64 * stride_gt + i_h).to(tl.float32),
                              tl.load(BETA + t64 * stride_bt + i_h).to(tl.float32))
        tl.store(O + t64 * stride_ot + i_h * stride_oh + o_v, b_o.to(O.dtype.element_ty), mask=m_v)
        # a tap after this token: its state to the tap's slot (branch-free: a masked store)
        hit = (t - start + 1) == next_n
        dst = tl.load(TAP_DST + tap, mask=hit, other=0).to(tl.int64)
        m_hit = (o_k[:, None] * 0 + hit.to(tl.int32)) > 0          # broadcast: the interpreter rejects a scalar mask here
        tl.store(POOL + dst * stride_pp + off_s, b_s.to(POOL.dtype.element_ty), mask=m_s & m_hit)
        tap = tap + hit.to(tl.int32)
        next_n = tl.load(TAP_N + tap, mask=tap < tap_hi, other=-1)
        t64 += 1
    tl.store(POOL + slot * stride_pp + off_s, b_s.to(POOL.dtype.element_ty), mask=m_s)


def tap_arrays(taps: list[list[tuple[int, int]]], dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence tap lists -> (offsets [N+1], n [total], dst [total]) int32 (one sentinel entry
    keeps the arrays non-empty)."""
    lo = [0]
    for t in taps:
        lo.append(lo[-1] + len(t))
    flat = [x for t in taps for x in t] or [(-1, 0)]
    n = torch.tensor([a for a, _ in flat], dtype=torch.int32, device=dev)
    dst = torch.tensor([b for _, b in flat], dtype=torch.int32, device=dev)
    return torch.tensor(lo, dtype=torch.int32, device=dev), n, dst


def gated_delta_rule_prefill_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, o: torch.Tensor, pool: torch.Tensor,
                                   bounds: list[tuple[int, int]], slots: list[int],
                                   taps: list[list[tuple[int, int]]]) -> None:
    """packed.gated_delta_rule_prefill_slots (q, k L2-normalized; see its docstring)."""
    if not bounds:
        return
    Hk, Hv, DV = k.shape[1], v.shape[1], v.shape[2]
    if Hv % Hk != 0:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("pool", pool)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
    if pool.stride(2) != DV:
        raise ValueError("the pool's states must be contiguous [K, V] blocks")
    if max(e - s for s, e in bounds) < CHUNK:
        _recurrent(q, k, v, g, beta, o, pool, bounds, slots, taps)
        return
    pieces = []
    for (s, e), cuts in zip(bounds, taps):
        ends = [s + n for n, _ in cuts] + [e]
        pieces.append(list(zip([s] + ends[:-1], ends, [d for _, d in cuts] + [-1])))
    for r in range(max(len(p) for p in pieces)):
        now = [(i, p[r]) for i, p in enumerate(pieces) if r < len(p)]
        chunk_gated_delta_rule_slots(q, k, v, g, beta, o, pool, [(a, b) for _, (a, b, _) in now],
                                     [slots[i] for i, _ in now])
        copies = [(slots[i], dst) for i, (_, _, dst) in now if dst >= 0]
        if copies:
            src, dst = zip(*copies)
            pool[torch.tensor(dst, device=pool.device)] = pool[torch.tensor(src, device=pool.device)]


def _recurrent(q, k, v, g, beta, o, pool, bounds: list[tuple[int, int]], slots: list[int],
               taps: list[list[tuple[int, int]]]) -> None:
    N = len(bounds)
    Hk, DK = k.shape[1], k.shape[2]
    Hv, DV = v.shape[1], v.shape[2]
    dev = q.device
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int32, device=dev)
    ends = torch.tensor([e for _, e in bounds], dtype=torch.int32, device=dev)
    tap_lo, tap_n, tap_dst = tap_arrays(taps, dev)
    g, beta = g.contiguous(), beta.contiguous()
    # the interpreter runs programs one after another, each op costing the same at any block size:
    # fewer, wider programs there
    BLOCK_V = triton.next_power_of_2(DV) if interpreting() else min(32, triton.next_power_of_2(DV))
    _gdr_prefill[(N, Hv, triton.cdiv(DV, BLOCK_V))](
        q, k, v, g, beta, o, pool, starts, ends, torch.tensor(slots, dtype=torch.int32, device=dev),
        tap_lo, tap_n, tap_dst, DK ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
        GROUP=Hv // Hk, DK=DK, DV=DV, BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=BLOCK_V)
