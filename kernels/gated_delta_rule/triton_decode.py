"""The fused single-step gated delta rule in Triton: decode for N sequences whose states stay in
the state pool, read and written in place by slot (`naive.gated_delta_rule_decode_slots` without
its gather and scatter copies of every state).

    grid (N, Hv, V / BLOCK_V): program (n, h, j) owns columns j*BLOCK_V.. of the state of head h
    of sequence n, S [K, BLOCK_V]: every column of S evolves on its own (the update below never
    mixes columns), so the programs share nothing but the q/k row they each normalize

    S' = e^g S;  delta = beta (v - S'^T k);  S = S' + k delta^T;  o = S^T q

One pass over the state: it is loaded once, updated in registers and stored once, which is the
whole cost of decode for this layer (the state is K x V per head, the token a few vectors).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..packing import depth_layout

__all__ = ["gated_delta_rule_decode_slots", "gated_delta_rule_decode_depths_slots"]


@triton.jit
def qk_normalized(b_q, b_k, scale, L2NORM: tl.constexpr):
    """One token's q and k ([BK] fp32): L2-normalized (eps inside the sqrt, as naive.l2norm), q scaled."""
    if L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    return b_q * scale, b_k


@triton.jit
def delta_step(b_s, b_q, b_k, b_v, b_g, b_beta):
    """One token through the rule on state columns b_s [BK, BV] (the module docstring's update):
    returns the new state and the token's output columns [BV]."""
    b_s = b_s * tl.exp(b_g)
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta                               # [BV]
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    return b_s, tl.sum(b_s * b_q[:, None], axis=0)


@triton.jit
def _gdr_decode(Q, K, V, G, BETA, POOL, SLOTS, O, scale,
                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_bn,
                stride_pp, stride_ph, stride_pk, stride_on, stride_oh,
                GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    i_n, i_h, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // GROUP
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k, m_v = o_k < DK, o_v < DV
    b_q = tl.load(Q + i_n * stride_qn + i_hk * stride_qh + o_k, mask=m_k, other=0.).to(tl.float32)   # [BK]
    b_k = tl.load(K + i_n * stride_kn + i_hk * stride_kh + o_k, mask=m_k, other=0.).to(tl.float32)   # [BK]
    b_q, b_k = qk_normalized(b_q, b_k, scale, L2NORM)
    b_v = tl.load(V + i_n * stride_vn + i_h * stride_vh + o_v, mask=m_v, other=0.).to(tl.float32)   # [BV]
    b_g = tl.load(G + i_n * stride_gn + i_h).to(tl.float32)
    b_beta = tl.load(BETA + i_n * stride_bn + i_h).to(tl.float32)

    slot = tl.load(SLOTS + i_n).to(tl.int64)
    p_s = POOL + slot * stride_pp + i_h * stride_ph + o_k[:, None] * stride_pk + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s, b_o = delta_step(tl.load(p_s, mask=m_s, other=0.).to(tl.float32), b_q, b_k, b_v, b_g, b_beta)
    tl.store(p_s, b_s.to(POOL.dtype.element_ty), mask=m_s)
    tl.store(O + i_n * stride_on + i_h * stride_oh + o_v, b_o.to(O.dtype.element_ty), mask=m_v)


def gated_delta_rule_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                  use_qk_l2norm: bool = True) -> torch.Tensor:
    """naive.gated_delta_rule_decode_slots: q, k [N, Hk, K]; v [N, Hv, V]; g, beta [N, Hv];
    pool [P, Hv, K, V] updated in place at slots [N]; returns o [N, Hv, V] in q's dtype."""
    N, Hk, DK = k.shape
    Hv, DV = v.shape[1], v.shape[2]
    if Hv % Hk != 0:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if N == 0:
        return v.new_empty(0, Hv, DV, dtype=q.dtype)
    for name, t in (("q", q), ("k", k), ("v", v), ("pool", pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
    if pool.stride(2) != DV:
        raise ValueError("the pool's states must be contiguous [K, V] blocks")
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty(N, Hv, DV, dtype=q.dtype, device=q.device)
    BLOCK_V = min(32, triton.next_power_of_2(DV))
    _gdr_decode[(N, Hv, triton.cdiv(DV, BLOCK_V))](
        q, k, v, g, beta, pool, slots.contiguous(), o, DK ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        pool.stride(0), pool.stride(1), pool.stride(2), o.stride(0), o.stride(1),
        GROUP=Hv // Hk, DK=DK, DV=DV, L2NORM=use_qk_l2norm, BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=BLOCK_V)
    return o


@triton.jit
def _gdr_depths(Q, K, V, G, BETA, O, POOL, SLOTS, OFFS, LENS, SAVED, scale,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                stride_ot, stride_oh, stride_pp, stride_ph, stride_pk, stride_sd, stride_sn,
                GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_V: tl.constexpr):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // GROUP
    n_depths = tl.load(LENS + i_n)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k, m_v = o_k < DK, o_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    off_s = i_h * stride_ph + o_k[:, None] * stride_pk + o_v[None, :]
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    b_s = tl.load(POOL + slot * stride_pp + off_s, mask=m_s, other=0.).to(tl.float32)         # [BK, BV]
    p_saved = SAVED + i_n.to(tl.int64) * stride_sn + off_s
    for d in range(0, n_depths):
        row = (tl.load(OFFS + d) + i_n).to(tl.int64)            # depth-major rows: depth d's i-th
        b_q = tl.load(Q + row * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(K + row * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.).to(tl.float32)
        b_q, b_k = qk_normalized(b_q, b_k, scale, True)
        b_v = tl.load(V + row * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.).to(tl.float32)
        b_s, b_o = delta_step(b_s, b_q, b_k, b_v, tl.load(G + row * stride_gt + i_h).to(tl.float32),
                              tl.load(BETA + row * stride_bt + i_h).to(tl.float32))
        tl.store(O + row * stride_ot + i_h * stride_oh + o_v, b_o.to(O.dtype.element_ty), mask=m_v)
        # below the sequence's last depth: keep the state, for undoing a rejected draft tail
        m_keep = (o_k[:, None] * 0 + d) < n_depths - 1          # block-shaped (see triton_prefill)
        tl.store(p_saved, b_s, mask=m_s & m_keep)
        p_saved += stride_sd                                     # a pointer step: no int32 d * stride
    tl.store(POOL + slot * stride_pp + off_s, b_s.to(POOL.dtype.element_ty), mask=m_s)


def gated_delta_rule_decode_depths_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                         beta: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                                         counts: list[int], use_qk_l2norm: bool = True,
                                         keep: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """naive.gated_delta_rule_decode_depths_slots: a decode step with jump-forward drafts, rows
    depth-major; each program runs its sequence's depths in turn with the state in registers and
    stores the state after every depth but its last into `saved` ([D-1, N, Hv, K, V], returned as
    views saved[d][:counts[d+1]]). `keep` is accepted for the reference's signature; the stores
    are kept either way (from registers, a small part of the kernel's traffic)."""
    if not use_qk_l2norm:
        raise ValueError("the depth kernel normalizes q and k (as every Gated DeltaNet layer does)")
    N, D = counts[0], len(counts)
    Hk, DK = k.shape[1], k.shape[2]
    Hv, DV = v.shape[1], v.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v), ("pool", pool)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
    if pool.stride(2) != DV:
        raise ValueError("the pool's states must be contiguous [K, V] blocks")
    dev = q.device
    offs, lens = depth_layout(counts, dev)
    saved = torch.empty(max(D - 1, 1), N, Hv, DK, DV, dtype=torch.float32, device=dev)
    o = torch.empty(v.shape[0], Hv, DV, dtype=q.dtype, device=dev)
    g, beta = g.contiguous(), beta.contiguous()
    BLOCK_V = min(32, triton.next_power_of_2(DV))
    _gdr_depths[(N, Hv, triton.cdiv(DV, BLOCK_V))](
        q, k, v, g, beta, o, pool, slots.contiguous(), offs, lens, saved, DK ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), pool.stride(0), pool.stride(1), pool.stride(2), saved.stride(0), saved.stride(1),
        GROUP=Hv // Hk, DK=DK, DV=DV, BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=BLOCK_V)
    return o, [saved[d, :counts[d + 1]] for d in range(D - 1)]
