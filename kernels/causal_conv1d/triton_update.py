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

__all__ = ["causal_conv1d_update_slots"]


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
