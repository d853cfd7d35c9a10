"""Writing new K/V into the paged pool in Triton: `naive.write_kv` without its two index_copy_
launches and the cast's temporary. A program writes BLOCK_T tokens' K and V rows, every kv head,
cast to the pool's dtype on the way (a token's slot is wherever its page put it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["write_kv"]

BLOCK_T = 16


@triton.jit
def _write_kv(K_CACHE, V_CACHE, SLOTS, K, V, T, stride_cs, stride_ch, stride_vs, stride_vh,
              stride_kt, stride_kh, stride_nt, stride_nh,
              H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i_t = tl.program_id(0)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_t = o_t < T
    mask = m_t[:, None, None] & (o_h[None, :, None] < H) & (o_d[None, None, :] < D)                # [BT, BH, BD]
    b_slot = tl.load(SLOTS + o_t, mask=m_t, other=0).to(tl.int64)                                  # [BT]
    off_in = o_h[None, :, None] * stride_kh + o_d[None, None, :]
    b_k = tl.load(K + o_t[:, None, None] * stride_kt + off_in, mask=mask)
    b_v = tl.load(V + o_t[:, None, None] * stride_nt + o_h[None, :, None] * stride_nh + o_d[None, None, :], mask=mask)
    p_k = K_CACHE + b_slot[:, None, None] * stride_cs + o_h[None, :, None] * stride_ch + o_d[None, None, :]
    p_v = V_CACHE + b_slot[:, None, None] * stride_vs + o_h[None, :, None] * stride_vh + o_d[None, None, :]
    tl.store(p_k, b_k.to(K_CACHE.dtype.element_ty), mask=mask)
    tl.store(p_v, b_v.to(V_CACHE.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """naive.write_kv: k_cache, v_cache [S, Hkv, D]; slots [T]; k, v [T, Hkv, D]."""
    T, H, D = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("write_kv needs the head dim contiguous")
    _write_kv[(triton.cdiv(T, BLOCK_T),)](
        k_cache, v_cache, slots.contiguous(), k, v, T, k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H=H, D=D, BLOCK_T=BLOCK_T, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))
