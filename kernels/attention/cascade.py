"""Cascade attention: a prefix shared by several sequences of a batch is read once.

RadixAttention hands every request that matched the same cached prefix the same pages, so in a
batch many sequences' page tables start identically. Attention splits at the end of that shared
prefix and the two parts are merged exactly through their log-sum-exp:

    seq i:  [ shared prefix (same pages for the whole group) | own tokens ]
    o_i  =  merge( attend(q_i, K_shared), attend(q_i, K_own_i) )

The shared part becomes one large matmul for all the group's queries (no mask: every query comes
after the whole prefix) instead of one gather of the prefix per sequence.

`attend_lse` has two siblings with one signature: `_attend_ref` (pure torch, always there) and
`_attend_flash` (the CPU flash-attention op, which also returns the LSE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..packing import gather_rows

__all__ = ["SharedPrefix", "attend_lse", "attend_at", "merge", "cascade_prefill", "cascade_decode", "own_decode", "with_shared"]

PADDED_LIMIT = 1 << 21   # query x key pairs up to which short own parts share one padded batch
LONG_OWN = 256           # decode: an own part longer than this and than twice the median is read alone


@dataclass
class SharedPrefix:
    seqs: list[int]          # indices (into the batch) of the sequences sharing the prefix
    slots: torch.Tensor      # [S] int64 slots of the shared tokens (the first S tokens of each)
    start: int = -1          # >= 0 when the slots are the contiguous range [start, start + S)

    def kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared K/V; a view, not a copy, when the pages happen to be contiguous (a prefix
        allocated in one go usually is)."""
        if self.start >= 0:
            return k_cache[self.start:self.start + len(self.slots)], v_cache[self.start:self.start + len(self.slots)]
        return gather_rows(k_cache, self.slots), gather_rows(v_cache, self.slots)


def _attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                q_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k/v [S, Hkv, D]; key j is visible to query t iff q_pos is None or j <= q_pos[t].
    Returns o [T, Hq, D] fp32 and lse [T, Hq] fp32 (natural log of the softmax denominator)."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    G = Hq // Hkv
    qf = q.float().reshape(T, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, T * G, D)   # [Hkv, T*G, D]
    s = torch.bmm(qf, k.float().permute(1, 2, 0)) * scale                               # [Hkv, T*G, S]
    if q_pos is not None:
        visible = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]          # [T, S]
        s = s.masked_fill(~visible.repeat_interleave(G, 0)[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                                   # [Hkv, T*G]
    o = torch.bmm(torch.exp(s - lse[..., None]), v.float().permute(1, 0, 2))           # [Hkv, T*G, D]
    o = o.reshape(Hkv, T, G, D).permute(1, 0, 2, 3).reshape(T, Hq, D)
    return o, lse.reshape(Hkv, T, G).permute(1, 0, 2).reshape(T, Hq)


def _attend_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  q_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    G = Hq // Hkv
    # fold the query heads of one kv head into the query axis: the op then needs no GQA support.
    # In the serving dtype: the op accumulates in fp32 whatever its inputs, and bf16 runs faster
    dt = q.dtype
    qf = q.reshape(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * T, D)
    mask = None
    if q_pos is not None:
        visible = torch.arange(S, device=q.device)[None, :] <= q_pos[:, None]          # [T, S]
        mask = torch.zeros(visible.shape, dtype=dt, device=q.device).masked_fill_(~visible, float("-inf"))
        mask = mask.repeat(G, 1)                                                       # rows: g-major, like qf
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf, k.to(dt).transpose(0, 1)[None], v.to(dt).transpose(0, 1)[None], 0.0, False, attn_mask=mask, scale=scale)
    o = o[0].float().reshape(Hkv, G, T, D).permute(2, 0, 1, 3).reshape(T, Hq, D)
    return o, lse[0].reshape(Hkv, G, T).permute(2, 0, 1).reshape(T, Hq)


def attend_lse(q, k, v, scale: float, q_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu" and k.shape[0] > 0:
        return _attend_flash(q, k, v, scale, q_pos)
    return _attend_ref(q, k, v, scale, q_pos)


def attend_at(q, k_cache, v_cache, slots: torch.Tensor, scale: float, q_pos: torch.Tensor | None = None,
              attend=None) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_lse over the keys at `slots` of the pool, gathered first. kernels/attention/cpu.py has a
    form with this signature that reads them where they lie."""
    return (attend or attend_lse)(q, gather_rows(k_cache, slots), gather_rows(v_cache, slots), scale, q_pos)


def _gathering(attend):
    """attend_at's form over `attend` (the keys gathered first): where no in-place form is given."""
    return lambda q, k_cache, v_cache, slots, scale, q_pos=None: attend_at(q, k_cache, v_cache, slots, scale, q_pos, attend)


def _shared(q, k_cache, v_cache, g: SharedPrefix, scale: float, attend, at) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's rows over its shared prefix (no mask: they all follow it): a view where the prefix is
    contiguous in the pool, else read at its slots."""
    if g.start >= 0:
        return attend(q, *g.kv(k_cache, v_cache), scale)
    return at(q, k_cache, v_cache, g.slots, scale)


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Exact combination of attention over two disjoint key sets. o: [T, H, D], lse: [T, H]."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


def cascade_prefill(q, k_cache, v_cache, bounds: list[tuple[int, int]], seq_slots: list[torch.Tensor],
                    prefix_lens: list[int], groups: list[SharedPrefix], scale: float, attend=None,
                    attend_in_place=None, attend_group=None) -> torch.Tensor:
    """Prefill of several sequences (packed q [T, Hq, D]); a group's shared prefix lies within every
    member's cached prefix, so all of the member's new tokens see all of it. `attend`: attend_lse's
    signature; `attend_in_place`: attend_at's, a form that reads keys where they lie in the pool
    (kernels/attention/cpu.py passes its kernel forms): with it a scattered shared prefix and a
    sequence alone are read in place, not gathered. `attend_group(q, k_cache, v_cache, g, bounds,
    seq_slots, prefix_lens, scale, out)`: a form that writes a whole group's rows of `out` (fp32) in
    one pass, shared and own parts together; the composition below is its reference."""
    attend = attend or attend_lse
    at = attend_in_place or _gathering(attend)
    dev = q.device
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    grouped, starts, sh_o, sh_lse, done = [], {}, [], [], set()
    for g in groups:
        if attend_group is not None:
            attend_group(q, k_cache, v_cache, g, bounds, seq_slots, prefix_lens, scale, out)
            done.update(g.seqs)
            continue
        rows = torch.cat([torch.arange(*bounds[i], device=dev) for i in g.seqs])
        o, lse = _shared(q[rows], k_cache, v_cache, g, scale, attend, at)
        sh_o.append(o)
        sh_lse.append(lse)
        grouped += g.seqs
        starts.update({i: len(g.slots) for i in g.seqs})
    if grouped:
        # own parts (what follows each shared prefix), in the packed order of `grouped` (the order
        # the shared parts were computed in): usually short, then one padded batch and one merge
        own_q = [q[bounds[i][0]:bounds[i][1]] for i in grouped]
        own_k = [seq_slots[i][starts[i]:] for i in grouped]
        q_off = [prefix_lens[i] - starts[i] for i in grouped]
        rows = torch.cat([torch.arange(*bounds[i], device=dev) for i in grouped])
        E, L = max(len(x) for x in own_q), max(len(x) for x in own_k)
        # (one sequence at a time, even by the kernel in place, was no faster)
        if len(grouped) * E * L <= PADDED_LIMIT:
            o, lse = _attend_padded(own_q, own_k, q_off, k_cache, v_cache, scale)
            flat = torch.cat([torch.arange(len(x), device=dev) + j * E for j, x in enumerate(own_q)])
            o, lse = o.flatten(0, 1)[flat], lse.flatten(0, 1)[flat]
        else:
            parts = [at(x, k_cache, v_cache, k, scale, torch.arange(off, off + len(x), device=dev))
                     for x, k, off in zip(own_q, own_k, q_off)]
            o, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        out[rows] = merge(o, lse, torch.cat(sh_o), torch.cat(sh_lse))
    alone = set(grouped) | done
    for i, (s, e) in enumerate(bounds):
        if i in alone:
            continue
        q_pos = torch.arange(prefix_lens[i], prefix_lens[i] + e - s, device=dev)
        out[s:e] = at(q[s:e], k_cache, v_cache, seq_slots[i], scale, q_pos)[0]
    return out.to(q.dtype)


def _attend_padded(qs: list[torch.Tensor], slots: list[torch.Tensor], q_off: list[int], k_cache, v_cache,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of several short sequences in one padded batch: sequence j's query t has
    position q_off[j] + t among its keys `slots[j]`. Returns o [N, Emax, Hq, D], lse [N, Emax, Hq]."""
    q = torch.nn.utils.rnn.pad_sequence(qs, batch_first=True)                          # [N, E, Hq, D]
    idx = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)                      # [N, L] (pad: slot 0)
    E, L, dev = q.shape[1], idx.shape[1], q.device
    lens = torch.tensor([len(x) for x in slots], device=dev)
    pos = torch.tensor(q_off, device=dev)[:, None] + torch.arange(E, device=dev)[None, :]   # [N, E]
    keys = torch.arange(L, device=dev)
    visible = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < lens[:, None, None])  # [N, E, L]
    return _padded(q, gather_rows(k_cache, idx), gather_rows(v_cache, idx), visible, scale)


def _padded(q, k, v, visible, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, E, Hq, D] over k/v [N, L, Hkv, D] where visible [N, E, L]; every query sees a key.
    Returns o [N, E, Hq, D] fp32 and lse [N, E, Hq]. On a CPU by the flash-attention op (one batch
    entry per sequence, the query heads of a kv head folded into its query rows, in the serving
    dtype): far faster than the einsums, and every layer of a shared-prefix batch's decode steps and
    prefills pays it."""
    return (_padded_flash if q.device.type == "cpu" else _padded_ref)(q, k, v, visible, scale)


def _padded_ref(q, k, v, visible, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, E, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    s = torch.einsum("nehgd,nlhd->nhgel", q.float().reshape(N, E, Hkv, G, D), k.float()) * scale   # [N, Hkv, G, E, L]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                                    # [N, Hkv, G, E]
    o = torch.einsum("nhgel,nlhd->nehgd", torch.exp(s - lse[..., None]), v.float())     # [N, E, Hkv, G, D]
    return o.reshape(N, E, Hq, D), lse.permute(0, 3, 1, 2).reshape(N, E, Hq)


def _padded_flash(q, k, v, visible, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, E, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dt = q.dtype
    qf = q.reshape(N, E, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(N, Hkv, G * E, D)   # rows: g-major
    mask = torch.zeros(visible.shape, dtype=dt, device=q.device).masked_fill_(~visible, float("-inf"))
    mask = mask[:, None].expand(N, G, E, L).reshape(N, 1, G * E, L)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qf, k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2), 0.0, False, attn_mask=mask, scale=scale)
    o = o.float().reshape(N, Hkv, G, E, D).permute(0, 3, 1, 2, 4).reshape(N, E, Hq, D)
    return o, lse.reshape(N, Hkv, G, E).permute(0, 3, 1, 2).reshape(N, E, Hq)


def cascade_decode(q, k_cache, v_cache, own_table: torch.Tensor, own_lens: torch.Tensor,
                   groups: list[SharedPrefix], scale: float) -> torch.Tensor:
    """Decode (q [N, Hq, D], one token each); `own_table` [N, Lmax] holds each sequence's slots
    after its group's shared prefix (all of them for a sequence in no group)."""
    o, lse = own_decode(q, k_cache, v_cache, own_table, own_lens, scale)
    return with_shared(q, k_cache, v_cache, groups, scale, o, lse)


def own_decode(q, k_cache, v_cache, own_table: torch.Tensor, own_lens: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention over its own part: o [N, Hq, D] fp32 and lse [N, Hq]."""
    N, Hq, D = q.shape
    lens = own_lens.tolist()
    # one padded batch reads every row's own part at the longest's length: a row far longer than
    # the rest (a sequence in no group, beside a group's short own parts) is attended alone, or
    # one 3,100-token row would make 39 grouped rows gather 3,100 slots each (120 MB a step)
    cut = max(2 * sorted(lens)[len(lens) // 2], LONG_OWN)
    long = [i for i, n in enumerate(lens) if n > cut]
    short = [i for i, n in enumerate(lens) if n <= cut]
    o = torch.empty((N, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((N, Hq), dtype=torch.float32, device=q.device)
    if short:
        rows = torch.tensor(short, device=q.device) if long else slice(None)
        L = max(lens[i] for i in short)
        idx = own_table[rows, :L].clamp(min=0)
        valid = torch.arange(L, device=q.device)[None, :] < own_lens[rows][:, None]   # [n, L]
        o_own, lse_own = _padded(q[rows][:, None], gather_rows(k_cache, idx), gather_rows(v_cache, idx),
                                 valid[:, None], scale)                        # one query per sequence
        o[rows], lse[rows] = o_own[:, 0], lse_own[:, 0]
    for i in long:
        slots = own_table[i, :lens[i]]
        o[i:i + 1], lse[i:i + 1] = attend_lse(q[i:i + 1], gather_rows(k_cache, slots), gather_rows(v_cache, slots), scale)
    return o, lse


def with_shared(q, k_cache, v_cache, groups: list[SharedPrefix], scale: float, o: torch.Tensor,
                lse: torch.Tensor, attend=None, attend_in_place=None) -> torch.Tensor:
    """Merge each group's shared prefix (read once for the group) into its rows' own-part attention
    (o, lse: own_decode's); the result in q's dtype. `attend`, `attend_in_place` as in cascade_prefill."""
    attend = attend or attend_lse
    at = attend_in_place or _gathering(attend)
    for g in groups:
        if g.seqs == list(range(len(q))):
            # the whole batch, in order (an agent's fan-out decoding together): no gathers, no scatter
            o_s, lse_s = _shared(q, k_cache, v_cache, g, scale, attend, at)
            o = merge(o, lse, o_s, lse_s)
            continue
        rows = torch.tensor(g.seqs, device=q.device)
        o_s, lse_s = _shared(q[rows], k_cache, v_cache, g, scale, attend, at)
        o[rows] = merge(o[rows], lse[rows], o_s, lse_s)
    return o.to(q.dtype)
