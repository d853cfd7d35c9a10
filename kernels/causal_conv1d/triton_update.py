"""The causal short convolution's decode step in Triton, on states that stay in the state pool
(`naive.causal_conv1d_update_slots` without its gather and scatter copies).

    grid (N, C / BLOCK_C): program (n, j) takes channels j*BLOCK_C.. of sequence n: its window is
    the W-1 stored inputs then x, y = act(window . weight), and the stored inputs shift by one
    (read before written, within the program: no other program touches these channels)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..packing import depth_layout

__all__ = ["causal_conv1d_update_slots", "causal_conv1d_update_depths_slots"]


@triton.jit
def _conv_update(X, POOL, WEIGHT, SLOTS, Y, stride_xn, stride_pp, stride_pc, stride_wc, stride_yn,
                 C: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    i_n, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_w = tl.arange(0, BLOCK_W)
    m_c = o_c < C
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    b_x = tl.load(X + i_n * stride_xn + o_c, mask=m_c, other=0.).to(tl.float32)                    # [BC]
    p_s = POOL + slot * stride_pp + o_c[:, None] * stride_pc + o_w[None, :]
    b_s = tl.load(p_s, mask=m_c[:, None] & (o_w[None, :] < W - 1), other=0.).to(tl.float32)       # [BC, BW]
    b_w = tl.load(WEIGHT + o_c[:, None] * stride_wc + o_w[None, :], mask=m_c[:, None] & (o_w[None, :] < W),
                  other=0.).to(tl.float32)                                                         # [BC, BW]
    # the window oldest first: the W-1 stored inputs at columns 0..W-2, x at column W-1
    b_win = tl.where(o_w[None, :] == W - 1, b_x[:, None], b_s)
    b_y = tl.sum(b_win * b_w, axis=1)
    if SILU:
        b_y = b_y / (1. + tl.exp(-b_y))
    tl.store(Y + i_n * stride_yn + o_c, b_y.to(Y.dtype.element_ty), mask=m_c)
    if W > 1:
        # shift: stored column w takes window column w+1
        b_next = tl.load(p_s + 1, mask=m_c[:, None] & (o_w[None, :] < W - 2), other=0.).to(tl.float32)
        b_next = tl.where(o_w[None, :] == W - 2, b_x[:, None], b_next)
        tl.store(p_s, b_next.to(POOL.dtype.element_ty), mask=m_c[:, None] & (o_w[None, :] < W - 1))


def causal_conv1d_update_slots(x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                               activation: str | None = "silu") -> torch.Tensor:
    """naive.causal_conv1d_update_slots: x [N, C]; pool [P, C, W-1] shifted in place at slots [N];
    weight [C, W]; returns y [N, C] in x's dtype."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    N, C = x.shape
    W = weight.shape[-1]
    y = torch.empty_like(x)
    if N == 0:
        return y
    if x.stride(-1) != 1 or pool.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x, pool and weight need their last dim contiguous")
    BLOCK_C = min(128, triton.next_power_of_2(C))
    _conv_update[(N, triton.cdiv(C, BLOCK_C))](
        x, pool, weight, slots.contiguous(), y, x.stride(0), pool.stride(0), pool.stride(1), weight.stride(0),
        y.stride(0), C=C, W=W, SILU=activation is not None, BLOCK_C=BLOCK_C, BLOCK_W=triton.next_power_of_2(W))
    return y


@triton.jit
def _conv_depths(X, Y, POOL, WEIGHT, SLOTS, OFFS, LENS, SAVED, stride_xt, stride_yt, stride_pp, stride_pc,
                 stride_wc, stride_sd, stride_sn, stride_sc,
                 C: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    n_depths = tl.load(LENS + i_n)
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_w = tl.arange(0, BLOCK_W)
    m_c = o_c < C
    # input p of the sequence's timeline: p < 0 is stored state column W-1+p, p >= 0 is its depth-p
    # row. Outputs, the saved states and the final state are all read from those two sources, so the
    # pool is written only at the end
    for d in range(0, n_depths):
        b_y = tl.zeros([BLOCK_C], tl.float32)
        for j in tl.static_range(W):
            p = o_c * 0 + (d - (W - 1) + j)                # block-shaped (see triton_prefill)
            b_w = tl.load(WEIGHT + o_c * stride_wc + j, mask=m_c, other=0.).to(tl.float32)
            row = (tl.load(OFFS + tl.maximum(p, 0)) + i_n).to(tl.int64)
            b_x = tl.load(X + row * stride_xt + o_c, mask=m_c & (p >= 0), other=0.).to(tl.float32)
            b_st = tl.load(POOL + slot * stride_pp + o_c * stride_pc + (W - 1 + p), mask=m_c & (p < 0),
                           other=0.).to(tl.float32)
            b_y += (b_x + b_st) * b_w
        if SILU:
            b_y = b_y / (1. + tl.exp(-b_y))
        row_d = (tl.load(OFFS + d) + i_n).to(tl.int64)
        tl.store(Y + row_d * stride_yt + o_c, b_y.to(Y.dtype.element_ty), mask=m_c)
    # the state after depth e (columns: inputs e+1-(W-1) .. e): saved below the last depth
    p_saved = SAVED + i_n.to(tl.int64) * stride_sn + o_c[:, None] * stride_sc + o_w[None, :]
    for e in range(0, n_depths - 1):
        p = e + 1 - (W - 1) + o_w                                                               # [BW]
        m = m_c[:, None] & (o_w[None, :] < W - 1)
        rows = (tl.load(OFFS + tl.maximum(p, 0), mask=o_w < W - 1, other=0) + i_n).to(tl.int64)
        b_x = tl.load(X + rows[None, :] * stride_xt + o_c[:, None], mask=m & (p[None, :] >= 0), other=0.)
        b_st = tl.load(POOL + slot * stride_pp + o_c[:, None] * stride_pc + (W - 1 + p)[None, :],
                       mask=m & (p[None, :] < 0), other=0.)
        tl.store(p_saved, (b_x.to(tl.float32) + b_st.to(tl.float32)).to(SAVED.dtype.element_ty), mask=m)
        p_saved += stride_sd
    # and after the last, into the pool (read above: nothing reads it after this)
    e = n_depths - 1
    p = e + 1 - (W - 1) + o_w
    m = m_c[:, None] & (o_w[None, :] < W - 1)
    rows = (tl.load(OFFS + tl.maximum(p, 0), mask=o_w < W - 1, other=0) + i_n).to(tl.int64)
    b_x = tl.load(X + rows[None, :] * stride_xt + o_c[:, None], mask=m & (p[None, :] >= 0), other=0.)
    b_st = tl.load(POOL + slot * stride_pp + o_c[:, None] * stride_pc + (W - 1 + p)[None, :],
                   mask=m & (p[None, :] < 0), other=0.)
    tl.store(POOL + slot * stride_pp + o_c[:, None] * stride_pc + o_w[None, :],
             (b_x.to(tl.float32) + b_st.to(tl.float32)).to(POOL.dtype.element_ty), mask=m)


def causal_conv1d_update_depths_slots(x: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                                      counts: list[int], activation: str | None = "silu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """naive.causal_conv1d_update_depths_slots: rows depth-major (x [T, C]); saved[d] [counts[d+1],
    C, W-1] the state after depth d (views of one new tensor)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    N, D = counts[0], len(counts)
    C, W = weight.shape
    if x.stride(-1) != 1 or pool.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x, pool and weight need their last dim contiguous")
    dev = x.device
    offs, lens = depth_layout(counts, dev)
    saved = torch.empty(max(D - 1, 1), N, C, max(W - 1, 1), dtype=pool.dtype, device=dev)
    y = torch.empty_like(x)
    BLOCK_C = min(128, triton.next_power_of_2(C))
    _conv_depths[(N, triton.cdiv(C, BLOCK_C))](
        x, y, pool, weight, slots.contiguous(), offs, lens, saved, x.stride(0), y.stride(0), pool.stride(0),
        pool.stride(1), weight.stride(0), saved.stride(0), saved.stride(1), saved.stride(2),
        C=C, W=W, SILU=activation is not None, BLOCK_C=BLOCK_C, BLOCK_W=triton.next_power_of_2(max(W - 1, 1)))
    return y, [saved[d, :counts[d + 1], :, :W - 1] for d in range(D - 1)]
