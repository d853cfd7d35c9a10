"""Pure-torch reference attention over a paged KV pool.

Per layer the pool is `k_cache`, `v_cache` of shape [S, Hkv, D], S = num_pages * page_size token
slots. A sequence's tokens live at arbitrary slots (its page table expanded to slots), so every
kernel first gathers the sequence's K/V by slot index, then runs dense attention with a mask.
GQA: Hq is a multiple of Hkv; query head h reads kv head h // (Hq // Hkv) (SDPA's enable_gqa).

Math in fp32 (the gathered K/V are cast), outputs in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["write_kv", "prefill_attention", "extend_attention", "decode_attention"]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new K/V into the pool, in place.

    Args:
        k_cache, v_cache: [S, Hkv, D]
        slots: [T] int64, distinct slot per token
        k, v: [T, Hkv, D] (cast to the pool's dtype)
    """
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def _gqa(num_q_heads: int, num_kv_heads: int) -> bool:
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    return num_q_heads != num_kv_heads


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    prefix_len: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of the E new tokens of one sequence over its whole context (with a sliding
    `window`, the new token at position i sees keys j with i - window < j <= i, as transformers'
    sliding-window mask).

    The new tokens' K/V must already be in the pool (write_kv first).

    Args:
        q: [E, Hq, D], the new tokens, absolute positions prefix_len .. prefix_len+E-1
        k_cache, v_cache: [S, Hkv, D]
        slots: [L] int64, the slot of every token of the sequence in order, L = prefix_len + E
        prefix_len: tokens already cached before the new ones (prefix cache hit / earlier chunks)
        scale: softmax scale, usually D**-0.5
        window: 0 for none
    Returns:
        o: [E, Hq, D] in q's dtype
    """
    E, Hq, _ = q.shape
    L = slots.shape[0]
    if L != prefix_len + E:
        raise ValueError(f"len(slots)={L} != prefix_len + E = {prefix_len} + {E}")
    lo = max(0, prefix_len - window + 1) if window else 0
    if lo:
        # keys before the first new token's window are seen by no new token
        slots, prefix_len, L = slots[lo:], prefix_len - lo, L - lo
    if window and L > window and E > 1:
        pos = torch.arange(L, device=q.device)
        qp = pos[prefix_len:, None]
        return _sdpa(q, k_cache, v_cache, slots, (pos[None, :] <= qp) & (pos[None, :] > qp - window), False, scale)
    if prefix_len == 0:
        # square causal: SDPA's top-left aligned is_causal is exactly right and needs no mask
        mask, causal = None, True
    else:
        # new token i sits at absolute position prefix_len + i and sees keys j <= prefix_len + i;
        # is_causal would align top-left (j <= i) and hide most of the prefix, so build the mask
        pos = torch.arange(L, device=q.device)
        mask, causal = pos[None, :] <= pos[prefix_len:, None], False  # [E, L] bool, True = attend
    return _sdpa(q, k_cache, v_cache, slots, mask, causal, scale)


def _sdpa(q, k_cache, v_cache, slots, mask, causal: bool, scale: float) -> torch.Tensor:
    """q [E, Hq, D] over the keys at `slots` under mask [E, L] (True = attend) or causal."""
    # in the serving dtype (a bf16 pool stays bf16), as cascade._attend_flash: SDPA's CPU kernel
    # accumulates in fp32 whatever its inputs, so upcast copies would only cost time (as close to
    # fp32 as transformers' bf16: test_model_parity)
    dt = q.dtype if q.dtype == k_cache.dtype else torch.float32
    k = k_cache.index_select(0, slots).to(dt).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v = v_cache.index_select(0, slots).to(dt).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    qf = q.to(dt).transpose(0, 1).unsqueeze(0)  # [1, Hq, E, D]
    o = F.scaled_dot_product_attention(
        qf, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=_gqa(q.shape[1], k.shape[1])
    )  # [1, Hq, E, D]
    return o[0].transpose(0, 1).to(q.dtype)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bounds: list[tuple[int, int]],
    seq_slots: list[torch.Tensor],
    prefix_lens: list[int],
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """prefill_attention for a packed batch of sequences: sequence i's new tokens are the rows
    bounds[i] = (start, end) of q [T, Hq, D], its keys seq_slots[i] (prefix_lens[i] cached, then
    the new ones, already written); a sliding `window` as prefill_attention's. Returns o [T, Hq, D]
    in q's dtype."""
    o = torch.empty_like(q)
    for (s, e), slots, p in zip(bounds, seq_slots, prefix_lens):
        o[s:e] = prefill_attention(q[s:e], k_cache, v_cache, slots, p, scale, window)
    return o


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its cached context, batched over sequences.

    The current token's K/V must already be in the pool.

    Args:
        q: [N, Hq, D]
        k_cache, v_cache: [S, Hkv, D]
        slot_table: [N, Lmax] int64, row n's first seq_lens[n] entries are its slots in order;
            the rest is padding (any value, never read)
        seq_lens: [N] int, valid slots per row including the current token, >= 1
        scale: softmax scale
    Returns:
        o: [N, Hq, D] in q's dtype
    """
    N, Hq, _ = q.shape
    Lmax = slot_table.shape[1]
    valid = torch.arange(Lmax, device=q.device)[None, :] < seq_lens.to(q.device)[:, None]  # [N, Lmax]
    # padding may hold out-of-range values (e.g. -1): point it at slot 0, the mask discards it
    slots = slot_table.masked_fill(~valid, 0)
    flat = slots.reshape(-1)  # index_select on a flat index is faster than advanced indexing
    k = k_cache.index_select(0, flat).view(N, Lmax, *k_cache.shape[1:]).float().transpose(1, 2)
    v = v_cache.index_select(0, flat).view(N, Lmax, *v_cache.shape[1:]).float().transpose(1, 2)  # [N, Hkv, Lmax, D]
    qf = q.float().unsqueeze(2)  # [N, Hq, 1, D]
    o = F.scaled_dot_product_attention(
        qf, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=_gqa(Hq, k.shape[1])
    )  # [N, Hq, 1, D]
    return o.squeeze(2).to(q.dtype)
