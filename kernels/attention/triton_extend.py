"""Attention of packed query chunks over paged keys in Triton: extend/prefill (a chunk of new tokens
attending causally to itself and its cached prefix), and the shared-prefix (cascade) form.

One kernel, `_attend_paged`, serves both. Sequence n owns the query rows cu_q[n] .. cu_q[n+1] of
the packed batch (variable lengths, no padding between them) and the keys table[n, :key_lens[n]]
(slots of the pool, in order). With CAUSAL its query i sits at position q_pos0[n] + i among those
keys and sees keys j <= q_pos0[n] + i (and with a sliding WINDOW only j > q_pos0[n] + i - WINDOW);
without, it sees them all (a shared prefix: every query of the group comes after it).

    grid (N, ceil(max q rows / BLOCK_M), Hkv): a program takes BLOCK_M query tokens x the G query
    heads of one kv head as one block of BLOCK_M * G rows, so each key tile it loads serves all of
    them; with CAUSAL it stops at the last key its last token sees

The cascade functions have the signatures of cascade.py's references: each group's queries go
through its shared prefix as one "sequence" (its keys read once per BLOCK_M tokens, not once per
member), every sequence's own keys in one more launch, and the two merge through their lse.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


from .cascade import SharedPrefix, merge
from .triton_decode import decode_attention_lse, dot_in_fp32, online_softmax, softmax_finish

__all__ = ["attend_paged", "extend_attention", "cascade_prefill", "cascade_decode"]

BLOCK_M = 16          # query tokens per program
BLOCK_N = 32          # keys per tile


@triton.jit
def _attend_paged(Q, K, V, CU_Q, TABLE, KEY_LENS, Q_POS0, O, LSE, scale,
                  stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tn,
                  stride_ot, stride_oh, stride_lt,
                  G: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    i_n, i_m, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(CU_Q + i_n)
    q_len = tl.load(CU_Q + i_n + 1) - q_start
    key_len = tl.load(KEY_LENS + i_n)
    pos0 = tl.load(Q_POS0 + i_n)

    o_r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = i_m * BLOCK_M + o_r // BLOCK_G                       # [BR] query token within the sequence
    head = i_h * G + o_r % BLOCK_G
    m_r = (tok < q_len) & (o_r % BLOCK_G < G)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    row = (q_start + tok).to(tl.int64)
    b_q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + o_d[None, :],
                  mask=m_r[:, None] & m_d[None, :], other=0.)                              # [BR, BD]
    b_q = b_q.to(tl.float32 if DOT_FP32 else K.dtype.element_ty)
    q_pos = pos0 + tok                                                                     # [BR]

    hi = key_len
    if CAUSAL:
        last = tl.minimum(q_len, (i_m + 1) * BLOCK_M) - 1
        hi = tl.minimum(key_len, pos0 + last + 1)
    hi = tl.where(i_m * BLOCK_M < q_len, hi, 0)                # a block past the sequence's rows: nothing
    lo = 0
    if WINDOW > 0:                                             # the block's first token's window starts here
        lo = tl.maximum(pos0 + i_m * BLOCK_M - WINDOW + 1, 0)

    b_m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    p_table = TABLE + i_n.to(tl.int64) * stride_tn
    for start in range(lo, hi, BLOCK_N):
        o_k = start + tl.arange(0, BLOCK_N)
        m_k = o_k < hi
        b_slot = tl.load(p_table + o_k, mask=m_k, other=0).to(tl.int64)                   # [BN]
        b_k = tl.load(K + b_slot[:, None] * stride_ks + i_h * stride_kh + o_d[None, :],
                      mask=m_k[:, None] & m_d[None, :], other=0.)                          # [BN, BD]
        b_v = tl.load(V + b_slot[:, None] * stride_vs + i_h * stride_vh + o_d[None, :],
                      mask=m_k[:, None] & m_d[None, :], other=0.)
        if DOT_FP32:
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale                # [BR, BN]
        visible = m_k[None, :]
        if CAUSAL:
            visible = visible & (o_k[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (o_k[None, :] > q_pos[:, None] - WINDOW)
        b_s = tl.where(visible, b_s, float("-inf"))
        b_m, b_l, b_acc = online_softmax(b_s, b_v, b_m, b_l, b_acc, PRECISION)

    b_o, b_lse = softmax_finish(b_m, b_l, b_acc)
    tl.store(O + row[:, None] * stride_ot + head[:, None] * stride_oh + o_d[None, :], b_o.to(O.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    tl.store(LSE + row * stride_lt + head, b_lse, mask=m_r)


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: torch.Tensor,
                 table: torch.Tensor, key_lens: torch.Tensor, q_pos0: torch.Tensor, causal: bool,
                 scale: float, max_q: int, out_dtype: torch.dtype | None = None,
                 window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] packed by cu_q [N+1]; table [N, Lmax] key slots, key_lens [N], q_pos0 [N] (see
    the module docstring); max_q: the longest sequence's rows; window: a causal sliding window (0 none). Returns o [T, Hq, D] in out_dtype
    (default q's) and lse [T, Hq] fp32 (-inf for a row that sees no key; its o is 0)."""
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    G = Hq // Hkv
    N = table.shape[0]
    o = torch.empty_like(q, dtype=out_dtype or q.dtype)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)
    if T == 0 or N == 0 or max_q == 0:
        return o, lse
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the pool need their head dim contiguous")
    dot_fp32 = dot_in_fp32(q, k_cache)
    dev = q.device
    table = table.to(dev).contiguous()
    BLOCK_G, BLOCK_D = triton.next_power_of_2(G), max(16, triton.next_power_of_2(D))
    # a program's accumulator is BLOCK_M * BLOCK_G x BLOCK_D fp32 (128 x 256 for a 27B-class
    # layer): more warps to hold it without spilling
    ints = [x.to(device=dev, dtype=torch.int32).contiguous() for x in (cu_q, key_lens, q_pos0)]
    _attend_paged[(N, triton.cdiv(max_q, BLOCK_M), Hkv)](
        q, k_cache, v_cache, ints[0], table, ints[1], ints[2], o, lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), o.stride(0), o.stride(1), lse.stride(0),
        G=G, D=D, CAUSAL=causal, WINDOW=window, BLOCK_M=BLOCK_M, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        DOT_FP32=dot_fp32, PRECISION="ieee" if dot_fp32 else "tf32",
        num_warps=8 if BLOCK_M * BLOCK_G * BLOCK_D >= 32768 else 4)
    return o, lse


def _table(slot_lists: list[torch.Tensor], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Key slot lists -> a padded [N, Lmax] table (padding never read) and their lengths."""
    lens = torch.tensor([len(s) for s in slot_lists], dtype=torch.int32)
    if not slot_lists or int(lens.max()) == 0:
        return torch.zeros(len(slot_lists), 1, dtype=torch.int64, device=dev), lens
    return torch.nn.utils.rnn.pad_sequence([s.to(dev) for s in slot_lists], batch_first=True), lens


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bounds: list[tuple[int, int]],
                     seq_slots: list[torch.Tensor], prefix_lens: list[int], scale: float, window: int = 0) -> torch.Tensor:
    """naive.extend_attention: every sequence's chunk in one launch."""
    table, key_lens = _table(seq_slots, q.device)
    cu = torch.tensor([0] + [e for _, e in bounds], dtype=torch.int32)
    o, _ = attend_paged(q, k_cache, v_cache, cu, table, key_lens, torch.tensor(prefix_lens, dtype=torch.int32),
                        True, scale, max((e - s for s, e in bounds), default=0), window=window)
    return o


def _shared(q: torch.Tensor, k_cache, v_cache, groups: list[SharedPrefix], rows_of, scale: float):
    """Each group's rows of q over its shared prefix (no mask), one launch for all groups.
    Returns the rows (a permutation of q's grouped rows), o and lse for them."""
    dev = q.device
    rows = [rows_of(g) for g in groups]
    cu = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64).cumsum(0)
    idx = torch.cat(rows)
    table, key_lens = _table([g.slots for g in groups], dev)
    o, lse = attend_paged(q[idx].contiguous(), k_cache, v_cache, cu, table, key_lens,
                          torch.zeros(len(groups), dtype=torch.int32), False, scale, max(len(r) for r in rows),
                          out_dtype=torch.float32)
    return idx, o, lse


def cascade_prefill(q, k_cache, v_cache, bounds: list[tuple[int, int]], seq_slots: list[torch.Tensor],
                    prefix_lens: list[int], groups: list[SharedPrefix], scale: float) -> torch.Tensor:
    """cascade.cascade_prefill: each sequence's own keys (those after its group's shared prefix,
    or all of them) in one launch, the groups' shared prefixes in another, merged."""
    dev = q.device
    start = {i: len(g.slots) for g in groups for i in g.seqs}
    own = [seq_slots[i][start.get(i, 0):] for i in range(len(bounds))]
    table, key_lens = _table(own, dev)
    cu = torch.tensor([0] + [e for _, e in bounds], dtype=torch.int32)
    pos0 = torch.tensor([prefix_lens[i] - start.get(i, 0) for i in range(len(bounds))], dtype=torch.int32)
    o, lse = attend_paged(q, k_cache, v_cache, cu, table, key_lens, pos0, True, scale,
                          max((e - s for s, e in bounds), default=0), out_dtype=torch.float32)
    if groups:
        idx, o_s, lse_s = _shared(q, k_cache, v_cache, groups,
                                  lambda g: torch.cat([torch.arange(*bounds[i]) for i in g.seqs]), scale)
        idx = idx.to(dev)
        o[idx] = merge(o[idx], lse[idx], o_s, lse_s)
    return o.to(q.dtype)


def cascade_decode(q, k_cache, v_cache, own_table: torch.Tensor, own_lens: torch.Tensor,
                   groups: list[SharedPrefix], scale: float) -> torch.Tensor:
    """cascade.cascade_decode: the own parts through the paged decode kernel, the shared prefixes
    through _attend_paged (read once per BLOCK_M members), merged."""
    o, lse = decode_attention_lse(q, k_cache, v_cache, own_table, own_lens, scale, out_dtype=torch.float32)
    if groups:
        idx, o_s, lse_s = _shared(q, k_cache, v_cache, groups, lambda g: torch.tensor(g.seqs), scale)
        idx = idx.to(q.device)
        o[idx] = merge(o[idx], lse[idx], o_s, lse_s)
    return o.to(q.dtype)
