"""Paged decode attention in Triton: one query token per sequence over its slots, split-K.

The same contract as `naive.decode_attention` (pool [S, Hkv, D], slot_table [N, Lmax], seq_lens
[N]), without the gather: each program reads its keys straight from the pool through the slot
table, so nothing of size N x Lmax is ever materialized or upcast.

    grid (N, Hkv, SPLITS): program (n, h, s) takes the G = Hq / Hkv query heads of kv head h
    (one [G, D] block, padded to the 16 rows tl.dot needs: every key tile is read once for all
    of them) over its share of the
    sequence's keys, with an online softmax -> partial o [G, D] and lse [G]
    grid (N, Hq):          the splits' partials merged through their lse (split-K)

Split-K keeps a long context from leaving a small batch on a handful of programs: a batch of 4
over 32k keys is otherwise 4 x Hkv programs on a GPU with a hundred-odd SMs. Splits past a
sequence's end see no keys (lse = -inf) and weigh nothing in the merge.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting

__all__ = ["decode_attention", "decode_attention_lse"]

BLOCK_N = 32          # keys per tile


@triton.jit
def online_softmax(b_s, b_v, b_m, b_l, b_acc, PRECISION: tl.constexpr):
    """One key tile into a flash-attention row state: scores b_s [R, BN] (masked keys at -inf),
    values b_v [BN, BD]; running max b_m, denominator b_l [R] and unnormalized output b_acc [R, BD]."""
    b_mnew = tl.maximum(b_m, tl.max(b_s, axis=1))
    # a row that has seen no key yet keeps m = -inf; measure it from 0 so that no -inf - -inf
    b_base = tl.where(b_mnew == float("-inf"), 0., b_mnew)
    b_alpha = tl.exp(b_m - b_base)
    b_p = tl.exp(b_s - b_base[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_mnew, b_l, b_acc


@triton.jit
def softmax_finish(b_m, b_l, b_acc):
    """The normalized output and its lse; a row that saw no key (l = 0) gets o = 0, lse = -inf."""
    b_den = tl.where(b_l > 0, b_l, 1.)
    return b_acc / b_den[:, None], tl.where(b_l > 0, b_m + tl.log(b_den), float("-inf"))


def dot_in_fp32(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """fp32 anywhere (the query or the pool) keeps the products in fp32 ("ieee": no TF32 rounding),
    as the reference does; 16-bit query and pool multiply in 16 bits and accumulate in fp32.
    Triton's interpreter multiplies bf16 blocks wrongly (their bits as integers), so it gets fp32."""
    return q.dtype == torch.float32 or pool.dtype == torch.float32 or interpreting()


@triton.jit
def _decode_split(Q, K, V, TABLE, LENS, O_PART, LSE_PART, scale,
                  stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tn,
                  stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                  G: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    i_n, i_h, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n64 = i_n.to(tl.int64)
    seq_len = tl.load(LENS + i_n)
    lo = i_s * CHUNK
    hi = tl.minimum(lo + CHUNK, seq_len)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < D
    heads = i_h * G + o_g
    p_q = Q + i_n64 * stride_qn + heads[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.)                    # [BG, BD]
    b_q = b_q.to(tl.float32 if DOT_FP32 else K.dtype.element_ty)

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        o_k = start + tl.arange(0, BLOCK_N)
        m_k = o_k < hi
        b_slot = tl.load(TABLE + i_n64 * stride_tn + o_k, mask=m_k, other=0).to(tl.int64)   # [BN]
        p_k = K + b_slot[:, None] * stride_ks + i_h * stride_kh + o_d[None, :]
        p_v = V + b_slot[:, None] * stride_vs + i_h * stride_vh + o_d[None, :]
        b_k = tl.load(p_k, mask=m_k[:, None] & m_d[None, :], other=0.)                  # [BN, BD]
        b_v = tl.load(p_v, mask=m_k[:, None] & m_d[None, :], other=0.)                  # [BN, BD]
        if DOT_FP32:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale             # [BG, BN]
        b_s = tl.where(m_k[None, :], b_s, float("-inf"))
        b_m, b_l, b_acc = online_softmax(b_s, b_v, b_m, b_l, b_acc, PRECISION)

    # an empty split (lo >= hi) leaves l = 0: its lse is -inf and the merge gives it no weight
    b_o, b_lse = softmax_finish(b_m, b_l, b_acc)
    p_o = O_PART + i_n64 * stride_on + heads[:, None] * stride_oh + i_s * stride_os + o_d[None, :]
    tl.store(p_o, b_o, mask=m_g[:, None] & m_d[None, :])
    tl.store(LSE_PART + i_n64 * stride_ln + heads * stride_lh + i_s, b_lse, mask=m_g)


@triton.jit
def _decode_merge(O_PART, LSE_PART, O, LSE, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                  stride_out_n, stride_out_h, stride_lse_n, SPLITS: tl.constexpr, D: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < SPLITS
    b_lse = tl.load(LSE_PART + i_n * stride_ln + i_h * stride_lh + o_s, mask=m_s, other=float("-inf"))   # [BS]
    b_max = tl.max(b_lse, axis=0)
    b_max = tl.where(b_max == float("-inf"), 0., b_max)          # no split saw a key (no NaN)
    b_w = tl.where(m_s, tl.exp(b_lse - b_max), 0.)
    p_o = O_PART + i_n * stride_on + i_h * stride_oh + o_s[:, None] * stride_os + o_d[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None] & (o_d[None, :] < D), other=0.)                                 # [BS, BD]
    b_sum = tl.sum(b_w, axis=0)
    b_out = tl.sum(b_o * b_w[:, None], axis=0) / b_sum
    tl.store(O + i_n * stride_out_n + i_h * stride_out_h + o_d, b_out.to(O.dtype.element_ty), mask=o_d < D)
    tl.store(LSE + i_n * stride_lse_n + i_h, b_max + tl.log(b_sum))


def _splits(lmax: int, batch_heads: int) -> int:
    """Enough programs to fill a large GPU (~4 per SM on 132 SMs), none shorter than two tiles."""
    by_work = max(1, 512 // max(batch_heads, 1))
    by_len = max(1, triton.cdiv(lmax, 2 * BLOCK_N))
    return min(by_work, by_len, 64)


def decode_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float,
                         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention's output (in out_dtype, default q's) and its log-sum-exp [N, Hq] fp32
    (natural log; what a cascade merges a shared prefix's part with)."""
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    G = Hq // Hkv
    lmax = slot_table.shape[1]
    splits = _splits(lmax, N * Hkv)
    chunk = triton.cdiv(triton.cdiv(lmax, splits), BLOCK_N) * BLOCK_N
    splits = max(1, triton.cdiv(lmax, chunk))
    q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the pool's head dim must be contiguous")
    table = slot_table.contiguous()
    lens = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    o_part = torch.empty(N, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(N, Hq, splits, dtype=torch.float32, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    dot_fp32 = dot_in_fp32(q, k_cache)
    _decode_split[(N, Hkv, splits)](
        q, k_cache, v_cache, table, lens, o_part, lse_part, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        G=G, D=D, CHUNK=chunk, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32")
    o = torch.empty_like(q, dtype=out_dtype or q.dtype)
    lse = torch.empty(N, Hq, dtype=torch.float32, device=q.device)
    _decode_merge[(N, Hq)](
        o_part, lse_part, o, lse, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), o.stride(0), o.stride(1), lse.stride(0),
        SPLITS=splits, D=D, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=BLOCK_D,
        num_warps=8 if triton.next_power_of_2(splits) * BLOCK_D >= 8192 else 4)
    return o, lse


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """naive.decode_attention, read in place from the pool (see the module docstring)."""
    return decode_attention_lse(q, k_cache, v_cache, slot_table, seq_lens, scale)[0]
