"""The chunked gated delta rule in Triton: prefill of packed sequences in chunks of CHUNK tokens,
as matrix products (tensor cores on a GPU) instead of a token-by-token recurrence.

Per chunk, with gamma = cumsum(g) inside it and S the state entering it (naive.chunk_gated_delta_rule
derives this):

    A      = strictly lower (beta_t e^{gamma_t - gamma_i} k_t . k_i)          [C, C]
    [U0 W] = (I + A)^-1 [beta V, beta e^gamma K]        (forward substitution, row by row)
    U      = U0 - W S
    O      = (e^gamma Q) S + ((Q K^T) * decay, diagonal included) U
    S'     = e^{gamma_C} S + (e^{gamma_C - gamma} K)^T U

    grid (N, Hv, V / BLOCK_V): a program carries columns of one head's state through every chunk
    of its sequence (the columns evolve independently, so the W S and the state update split
    along them). The tail chunk is masked: its missing tokens have k = v = beta = g = 0, which
    write nothing and decay nothing.

Checkpoint taps are handled by the caller (triton_prefill): a sequence is cut at its taps and the
pieces run in rounds, so the state at a tap is the state at the end of a piece.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting

__all__ = ["chunk_gated_delta_rule_slots", "CHUNK"]

CHUNK = 64


@triton.jit
def _gdr_chunk(Q, K, V, G, BETA, O, POOL, STARTS, ENDS, SLOTS, scale,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
               stride_ot, stride_oh, stride_pp, stride_ph, stride_pk,
               GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // GROUP
    start, end = tl.load(STARTS + i_n), tl.load(ENDS + i_n)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k, m_v = o_k < DK, o_v < DV
    off_s = i_h * stride_ph + o_k[:, None] * stride_pk + o_v[None, :]
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    b_s = tl.load(POOL + slot * stride_pp + off_s, mask=m_k[:, None] & m_v[None, :], other=0.).to(tl.float32)
    lower = o_c[:, None] > o_c[None, :]                            # [C, C] strictly lower
    causal = o_c[:, None] >= o_c[None, :]                          # diagonal included
    for c0 in range(start, end, C):
        rows = (c0 + o_c).to(tl.int64)
        m_t = c0 + o_c < end
        b_q = tl.load(Q + rows[:, None] * stride_qt + i_hk * stride_qh + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)                   # [C, BK]
        b_k = tl.load(K + rows[:, None] * stride_kt + i_hk * stride_kh + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None] * scale
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_v = tl.load(V + rows[:, None] * stride_vt + i_h * stride_vh + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)                   # [C, BV]
        b_g = tl.load(G + rows * stride_gt + i_h, mask=m_t, other=0.).to(tl.float32)               # [C]
        b_beta = tl.load(BETA + rows * stride_bt + i_h, mask=m_t, other=0.).to(tl.float32)
        b_gamma = tl.cumsum(b_g, axis=0)
        # e^{gamma_t - gamma_i} only where i <= t (the exponent is then <= 0: no overflow)
        b_decay = tl.exp(tl.where(causal, b_gamma[:, None] - b_gamma[None, :], float("-inf")))    # [C, C]
        b_a = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION) * b_decay * b_beta[:, None]
        b_a = tl.where(lower, b_a, 0.)
        # (I + A) X = B by forward substitution: row t is final once rows < t are subtracted out
        b_u = b_v * b_beta[:, None]                                                                # [C, BV]
        b_w = b_k * (b_beta * tl.exp(b_gamma))[:, None]                                            # [C, BK]
        for t in range(0, C):
            pick = o_c == t
            a_col = tl.sum(tl.where(pick[None, :], b_a, 0.), axis=1)                               # [C]: A[:, t]
            u_t = tl.sum(tl.where(pick[:, None], b_u, 0.), axis=0)                                 # [BV]
            w_t = tl.sum(tl.where(pick[:, None], b_w, 0.), axis=0)                                 # [BK]
            b_u = b_u - a_col[:, None] * u_t[None, :]
            b_w = b_w - a_col[:, None] * w_t[None, :]
        b_u = b_u - tl.dot(b_w, b_s, input_precision=PRECISION)                                    # [C, BV]
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_decay                     # [C, C]
        b_o = tl.dot(b_q * tl.exp(b_gamma)[:, None], b_s, input_precision=PRECISION) \
            + tl.dot(b_qk, b_u, input_precision=PRECISION)
        tl.store(O + rows[:, None] * stride_ot + i_h * stride_oh + o_v[None, :], b_o.to(O.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        g_last = tl.sum(tl.where(o_c == C - 1, b_gamma, 0.), axis=0)
        b_kd = b_k * tl.exp(g_last - b_gamma)[:, None]                                             # [C, BK]
        b_s = b_s * tl.exp(g_last) + tl.dot(tl.trans(b_kd), b_u, input_precision=PRECISION)
    tl.store(POOL + slot * stride_pp + off_s, b_s.to(POOL.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


def chunk_gated_delta_rule_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, o: torch.Tensor, pool: torch.Tensor,
                                 bounds: list[tuple[int, int]], slots: list[int]) -> None:
    """Packed sequences (rows bounds[i]) through the rule in chunks, from and into pool[slots[i]];
    o written at their rows. q, k L2-normalized. No taps (see the module docstring)."""
    N = len(bounds)
    if N == 0:
        return
    Hk, DK = k.shape[1], k.shape[2]
    Hv, DV = v.shape[1], v.shape[2]
    dev = q.device
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int32, device=dev)
    ends = torch.tensor([e for _, e in bounds], dtype=torch.int32, device=dev)
    g, beta = g.contiguous(), beta.contiguous()
    # the interpreter runs one program after another: one wide program per head there
    BLOCK_V = triton.next_power_of_2(DV) if interpreting() else min(32, triton.next_power_of_2(DV))
    _gdr_chunk[(N, Hv, triton.cdiv(DV, BLOCK_V))](
        q, k, v, g, beta, o, pool, starts, ends, torch.tensor(slots, dtype=torch.int32, device=dev), DK ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
        GROUP=Hv // Hk, DK=DK, DV=DV, C=CHUNK, BLOCK_K=max(16, triton.next_power_of_2(DK)), BLOCK_V=max(16, BLOCK_V),
        PRECISION="ieee" if interpreting() or q.dtype == torch.float32 else "tf32",
        # a chunk's q, k and W blocks are 64 x 128 fp32 each at Qwen3.5's head dims; the loop is
        # latency-bound, so no pipelining stages to fill shared memory with
        num_warps=8, num_stages=1)
