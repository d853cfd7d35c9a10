"""The causal short convolution over a packed prefill batch in Triton, states in the pool by slot,
with checkpoint taps (`packed.causal_conv1d_prefill_slots`).

Two launches, because every output block reads the sequence's stored state and the new state
must not overwrite it before they have:

    _conv_out     grid (N, ceil(max len / BLOCK_T), C / BLOCK_C): each token's window is its W-1
                  predecessors, taken from the packed inputs or, before the sequence's first token,
                  from the stored state; y = act(window . weight)
    _conv_states  grid (N, C / BLOCK_C): the state after each tap's n tokens, then after all of
                  them (the final state, into the sequence's own slot, last): the W-1 inputs before
                  position n, from the same two sources
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gated_delta_rule.triton_prefill import tap_arrays

__all__ = ["causal_conv1d_prefill_slots"]


@triton.jit
def _conv_out(X, Y, POOL, WEIGHT, STARTS, ENDS, SLOTS, stride_xt, stride_yt, stride_pp, stride_pc, stride_wc,
              C: tl.constexpr, W: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    i_n, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(STARTS + i_n), tl.load(ENDS + i_n)
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)                   # token index within the sequence
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_t, m_c = o_t < end - start, o_c < C
    b_y = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(W):
        p = o_t - (W - 1) + j                                      # the input's index (< 0: stored state)
        b_w = tl.load(WEIGHT + o_c * stride_wc + j, mask=m_c, other=0.).to(tl.float32)
        from_x = m_t & (p >= 0)
        b_x = tl.load(X + (start + p)[:, None].to(tl.int64) * stride_xt + o_c[None, :],
                      mask=from_x[:, None] & m_c[None, :], other=0.).to(tl.float32)
        from_s = m_t & (p < 0)
        b_st = tl.load(POOL + slot * stride_pp + o_c[None, :] * stride_pc + (W - 1 + p)[:, None],
                       mask=from_s[:, None] & m_c[None, :], other=0.).to(tl.float32)
        b_y += (b_x + b_st) * b_w[None, :]
    if SILU:
        b_y = b_y / (1. + tl.exp(-b_y))
    tl.store(Y + (start + o_t)[:, None].to(tl.int64) * stride_yt + o_c[None, :], b_y.to(Y.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _conv_states(X, POOL, STARTS, ENDS, SLOTS, TAP_LO, TAP_N, TAP_DST, stride_xt, stride_pp, stride_pc,
                 C: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(STARTS + i_n), tl.load(ENDS + i_n)
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    lo, hi = tl.load(TAP_LO + i_n), tl.load(TAP_LO + i_n + 1)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_w = tl.arange(0, BLOCK_W)
    m = (o_c[:, None] < C) & (o_w[None, :] < W - 1)
    for j in range(lo, hi + 1):                                    # the taps, then the final state
        is_tap = j < hi
        n = tl.load(TAP_N + j, mask=is_tap, other=0)
        n = tl.where(is_tap, n, end - start)
        dst = tl.load(TAP_DST + j, mask=is_tap, other=0).to(tl.int64)
        dst = tl.where(is_tap, dst, slot)
        p = n - (W - 1) + o_w                                      # [BW] input index of column w
        b_x = tl.load(X + (start + p)[None, :].to(tl.int64) * stride_xt + o_c[:, None],
                      mask=m & (p[None, :] >= 0), other=0.).to(tl.float32)
        b_st = tl.load(POOL + slot * stride_pp + o_c[:, None] * stride_pc + (W - 1 + p)[None, :],
                       mask=m & (p[None, :] < 0), other=0.).to(tl.float32)
        tl.store(POOL + dst * stride_pp + o_c[:, None] * stride_pc + o_w[None, :], (b_x + b_st).to(POOL.dtype.element_ty),
                 mask=m)


def causal_conv1d_prefill_slots(x: torch.Tensor, out: torch.Tensor, pool: torch.Tensor, weight: torch.Tensor,
                                bounds: list[tuple[int, int]], slots: list[int],
                                taps: list[list[tuple[int, int]]], activation: str | None = "silu") -> None:
    """packed.causal_conv1d_prefill_slots (see its docstring)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported activation {activation!r}")
    N = len(bounds)
    if N == 0:
        return
    C, W = weight.shape
    if x.stride(-1) != 1 or out.stride(-1) != 1 or pool.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x, out, pool and weight need their last dim contiguous")
    dev = x.device
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int32, device=dev)
    ends = torch.tensor([e for _, e in bounds], dtype=torch.int32, device=dev)
    sl = torch.tensor(slots, dtype=torch.int32, device=dev)
    BLOCK_T, BLOCK_C = 16, min(128, triton.next_power_of_2(C))
    max_len = max(e - s for s, e in bounds)
    _conv_out[(N, triton.cdiv(max_len, BLOCK_T), triton.cdiv(C, BLOCK_C))](
        x, out, pool, weight, starts, ends, sl, x.stride(0), out.stride(0), pool.stride(0), pool.stride(1),
        weight.stride(0), C=C, W=W, SILU=activation is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    if W > 1:
        tap_lo, tap_n, tap_dst = tap_arrays(taps, dev)
        _conv_states[(N, triton.cdiv(C, BLOCK_C))](
            x, pool, starts, ends, sl, tap_lo, tap_n, tap_dst, x.stride(0), pool.stride(0), pool.stride(1),
            C=C, W=W, BLOCK_C=BLOCK_C, BLOCK_W=triton.next_power_of_2(W - 1))
