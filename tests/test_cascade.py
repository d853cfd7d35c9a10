"""Cascade attention against plain paged attention, and the grouping of shared page tables."""
from __future__ import annotations

import pytest
import torch

from radixflow.kernels.attention import (SharedPrefix, cascade_decode, cascade_prefill, decode_attention, merge,
                                         prefill_attention)
from radixflow.kernels.attention.cascade import _attend_flash, _attend_ref
from radixflow.services.executor.runner import shared_prefixes

Hq, Hkv, D, PAGE = 4, 2, 32, 8


def dense(q, k, v, scale, q_pos):
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    if q_pos is not None:
        s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v), torch.logsumexp(s, -1).T


@pytest.mark.parametrize("impl", [_attend_ref, _attend_flash])
@pytest.mark.parametrize("T,S,causal", [(1, 1, False), (7, 63, False), (33, 100, True), (64, 65, True)])
def test_attend_lse_matches_dense(impl, T, S, causal):
    g = torch.Generator().manual_seed(T * S)
    q, k, v = torch.randn(T, Hq, D, generator=g), torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    q_pos = torch.arange(S - T, S) if causal else None
    o, lse = impl(q, k, v, D ** -0.5, q_pos)
    ro, rlse = dense(q, k, v, D ** -0.5, q_pos)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rlse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attend_flash_in_bf16_matches_dense_fp32_within_bf16_rounding(causal):
    """bf16 serving runs the flash op on bf16 inputs (it accumulates in fp32): against the fp32
    reference of the same bf16-rounded inputs, the output stays within bf16 output rounding and
    the LSE is fp32-exact."""
    T, S = 40, 300
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, D, generator=g).bfloat16() for n, h in ((T, Hq), (S, Hkv), (S, Hkv)))
    q_pos = torch.arange(S - T, S) if causal else None
    o, lse = _attend_flash(q, k, v, D ** -0.5, q_pos)
    ro, rlse = dense(q.float(), k.float(), v.float(), D ** -0.5, q_pos)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(o, ro, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, rlse, atol=1e-3, rtol=1e-3)


def test_merge_of_two_key_sets_is_exact():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, Hq, D, generator=g), torch.randn(50, Hkv, D, generator=g), torch.randn(50, Hkv, D, generator=g)
    o1, l1 = _attend_ref(q, k[:17], v[:17], 0.2, None)
    o2, l2 = _attend_ref(q, k[17:], v[17:], 0.2, None)
    torch.testing.assert_close(merge(o1, l1, o2, l2), dense(q, k, v, 0.2, None)[0], atol=1e-5, rtol=1e-5)


def _pool(n_pages=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_pages * PAGE, Hkv, D, generator=g), torch.randn(n_pages * PAGE, Hkv, D, generator=g)


def _slots(pages, n):
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]


def test_cascade_prefill_equals_per_sequence_prefill():
    kc, vc = _pool()
    shared = [40, 3, 17, 9]                     # 32 tokens every sequence has cached
    tables = [shared + [1, 2, 5], shared + [6, 7], shared + [8, 10, 11, 12], [20, 21, 22]]
    prefix = [37, 32, 40, 10]                   # cached tokens; the last sequence shares nothing
    ext = [12, 5, 20, 9]
    q = torch.randn(sum(ext), Hq, D)
    bounds, at = [], 0
    for e in ext:
        bounds.append((at, at + e))
        at += e
    seq_slots = [_slots(t, p + e) for t, p, e in zip(tables, prefix, ext)]
    groups = [SharedPrefix(seqs=[0, 1, 2], slots=_slots(shared, 32))]
    got = cascade_prefill(q, kc, vc, bounds, seq_slots, prefix, groups, D ** -0.5)
    # the same with contiguous shared pages, read as a view
    tables2 = [[40, 41, 42, 43] + t[4:] if i < 3 else t for i, t in enumerate(tables)]
    seq_slots2 = [_slots(t, p + e) for t, p, e in zip(tables2, prefix, ext)]
    groups2 = [SharedPrefix(seqs=[0, 1, 2], slots=_slots([40, 41, 42, 43], 32), start=40 * PAGE)]
    got2 = cascade_prefill(q, kc, vc, bounds, seq_slots2, prefix, groups2, D ** -0.5)
    want2 = torch.cat([prefill_attention(q[s:e], kc, vc, sl, p, D ** -0.5) for (s, e), sl, p in zip(bounds, seq_slots2, prefix)])
    torch.testing.assert_close(got2, want2, atol=1e-5, rtol=1e-5)
    want = torch.cat([prefill_attention(q[s:e], kc, vc, sl, p, D ** -0.5) for (s, e), sl, p in zip(bounds, seq_slots, prefix)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cascade_prefill_long_own_parts_take_the_unpadded_path(monkeypatch):
    import radixflow.kernels.attention.cascade as C
    monkeypatch.setattr(C, "PADDED_LIMIT", 0)
    test_cascade_prefill_equals_per_sequence_prefill()


def test_cascade_decode_equals_decode():
    kc, vc = _pool(seed=1)
    shared = [30, 31, 2, 4, 5, 15, 16, 18]      # 64 tokens
    tables = [shared + [6, 7], shared + [8], [9, 10, 11], shared + [12, 13, 14]]
    lens = [73, 65, 20, 84]
    seq_slots = [_slots(t, n) for t, n in zip(tables, lens)]
    q = torch.randn(4, Hq, D)
    table = torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True)
    want = decode_attention(q, kc, vc, table, torch.tensor(lens), D ** -0.5)
    groups = shared_prefixes(tables, [n - 1 for n in lens], PAGE, torch.device("cpu"))
    assert [g.seqs for g in groups] == [[0, 1, 3]] and len(groups[0].slots) == 64
    own = [sl[64:] if i != 2 else sl for i, sl in enumerate(seq_slots)]
    got = cascade_decode(q, kc, vc, torch.nn.utils.rnn.pad_sequence(own, batch_first=True),
                         torch.tensor([len(o) for o in own]), groups, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cascade_decode_of_a_whole_batch_in_one_group_equals_decode():
    """Every row in one group, in order (a fan-out decoding together): the merge runs on the whole
    batch without gathers, and gives what decode over each row's slots gives, and what the gathering
    path gives for the same rows listed out of order."""
    kc, vc = _pool(seed=2)
    shared = [30, 31, 2, 4, 5, 15, 16, 18]
    tables = [shared + [6, 7], shared + [8], shared + [12, 13, 14]]
    lens = [73, 65, 84]
    seq_slots = [_slots(t, n) for t, n in zip(tables, lens)]
    q = torch.randn(3, Hq, D)
    want = decode_attention(q, kc, vc, torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True),
                            torch.tensor(lens), D ** -0.5)
    groups = shared_prefixes(tables, [n - 1 for n in lens], PAGE, torch.device("cpu"))
    assert [g.seqs for g in groups] == [[0, 1, 2]]
    own = [sl[64:] for sl in seq_slots]
    args = (q, kc, vc, torch.nn.utils.rnn.pad_sequence(own, batch_first=True), torch.tensor([len(o) for o in own]))
    got = cascade_decode(*args, groups, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    listed = [SharedPrefix(seqs=[1, 0, 2], slots=groups[0].slots, start=groups[0].start)]
    assert torch.equal(cascade_decode(*args, listed, D ** -0.5), got)


def test_cascade_decode_reads_a_long_own_part_alone(monkeypatch):
    """A sequence in no group beside a group's members with short own parts: its row is attended
    alone (LONG_OWN), not padded into the batch of short rows, and every row still equals plain
    decode attention."""
    import radixflow.kernels.attention.cascade as C
    monkeypatch.setattr(C, "LONG_OWN", 16)
    kc, vc = _pool(n_pages=128, seed=2)
    shared = [30, 31, 2, 4, 5, 15, 16, 18]      # 64 tokens
    lone = list(range(40, 80))                  # 320 tokens in pages of its own
    tables = [shared + [6], shared + [8], lone, shared + [12], shared + [13]]
    lens = [70, 66, 317, 72, 65]
    seq_slots = [_slots(t, n) for t, n in zip(tables, lens)]
    q = torch.randn(5, Hq, D, generator=torch.Generator().manual_seed(3))
    want = decode_attention(q, kc, vc, torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True),
                            torch.tensor(lens), D ** -0.5)
    groups = shared_prefixes(tables, [n - 1 for n in lens], PAGE, torch.device("cpu"), singles=False)
    assert [g.seqs for g in groups] == [[0, 1, 3, 4]]
    own = [sl[64:] if i != 2 else sl for i, sl in enumerate(seq_slots)]
    gathered = []
    real = C.gather_rows
    monkeypatch.setattr(C, "gather_rows", lambda x, idx: (gathered.append(idx.numel()), real(x, idx))[1])
    got = cascade_decode(q, kc, vc, torch.nn.utils.rnn.pad_sequence(own, batch_first=True),
                         torch.tensor([len(o) for o in own]), groups, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the four short rows read 8 slots each (K and V), the long one its 317 (K and V), the group
    # its 64 shared ones (K and V): never 5 x 317
    assert sorted(gathered) == [32, 32, 64, 64, 317, 317], gathered


def test_shared_prefixes_respect_limits_and_minimum():
    base = list(range(1, 11))                                   # 10 shared pages = 80 tokens
    t = [base + [50, 51], base + [60], base[:9] + [70, 71]]
    groups = shared_prefixes(t, [96, 88, 96], PAGE, torch.device("cpu"))
    assert groups[0].seqs == [0, 1, 2] and len(groups[0].slots) == 9 * PAGE
    groups = shared_prefixes(t[:2], [96, 72], PAGE, torch.device("cpu"))   # one member computed only 9 pages
    assert len(groups[0].slots) == 9 * PAGE
    assert shared_prefixes(t, [96, 7, 96], PAGE, torch.device("cpu"))[0].seqs == [0, 2]
    assert shared_prefixes([base[:2] + [3], base[:2] + [4]], [24, 24], PAGE, torch.device("cpu")) == []  # < 64 tokens
    assert groups[0].start == 1 * PAGE                                   # pages 1..9: contiguous, read as a view
    assert shared_prefixes([[5, 9] + base, [5, 9] + base], [96, 96], PAGE, torch.device("cpu"))[0].start == -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_own_parts_match_their_references(dtype, monkeypatch):
    """The CPU flash-op form of the own-part attention (_padded_flash) equals the einsum reference
    (_padded_ref), for decode (one query per row over its own keys) and for prefill (several short
    causal sequences in one padded batch): fp32 to rounding, bf16 within bf16 rounding."""
    import radixflow.kernels.attention.cascade as C
    g = torch.Generator().manual_seed(11)
    kc, vc = (torch.randn(64 * PAGE, Hkv, D, generator=g).to(dtype) for _ in range(2))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    # decode: rows of 1..40 own keys, padded to 40
    lens = torch.tensor([1, 17, 40, 33, 8])
    table = torch.randint(0, 64 * PAGE, (5, 40), generator=g)
    valid = torch.arange(40)[None, :] < lens[:, None]
    q = torch.randn(5, 1, Hq, D, generator=g).to(dtype)
    k, v = kc[table], vc[table]
    for got, want in zip(C._padded_flash(q, k, v, valid[:, None], D ** -0.5), C._padded_ref(q, k, v, valid[:, None], D ** -0.5)):
        torch.testing.assert_close(got, want, **tol)
    # prefill: sequences of 3..12 new tokens after 0..20 earlier own keys
    news, offs = [3, 12, 7, 1], [0, 20, 5, 9]
    qs = [torch.randn(n, Hq, D, generator=g).to(dtype) for n in news]
    slots = [torch.randint(0, 64 * PAGE, (n + o,), generator=g) for n, o in zip(news, offs)]
    o1, l1 = C._attend_padded(qs, slots, offs, kc, vc, D ** -0.5)          # the flash op on a CPU
    monkeypatch.setattr(C, "_padded_flash", C._padded_ref)
    o2, l2 = C._attend_padded(qs, slots, offs, kc, vc, D ** -0.5)
    for j, n in enumerate(news):        # padded query rows are never read
        torch.testing.assert_close(o1[j, :n], o2[j, :n], **tol)
        torch.testing.assert_close(l1[j, :n], l2[j, :n], **tol)


def test_shared_prefixes_equals_the_page_by_page_comparison():
    """shared_prefixes compares page tables by slices (and bisects where they part); the groups are
    those of comparing them page by page."""
    import random

    def by_page(tables, limits, ps, singles=True):
        by_first = {}
        for i, (t, lim) in enumerate(zip(tables, limits)):
            if t and lim >= ps:
                by_first.setdefault(t[0], []).append(i)
        out = []
        for members in by_first.values():
            n = min(limits[i] for i in members) // ps
            first = tables[members[0]]
            for i in members[1:]:
                k = 0
                while k < n and tables[i][k] == first[k]:
                    k += 1
                n = k
            run = 1
            while run < n and first[run] == first[run - 1] + 1:
                run += 1
            if len(members) == 1:
                if not singles:
                    continue
                n = run
            if n * ps < (64 if len(members) > 1 else 512):
                continue
            out.append((members, first[:n], first[0] * ps if run >= n else -1))
        return out
    rng = random.Random(0)
    for _ in range(300):
        ps = rng.choice([1, 4, 16])
        base = list(range(rng.randrange(100), 200)) if rng.random() < 0.5 else rng.sample(range(1000), 150)
        tables, limits = [], []
        for _ in range(rng.randrange(1, 8)):
            cut = rng.randrange(len(base) + 1)
            tables.append(base[:cut] + rng.sample(range(2000, 3000), rng.randrange(0, 20)))
            limits.append(rng.randrange(0, len(tables[-1]) * ps + 1))
        for singles in (True, False):
            got = [(g.seqs, (g.slots[::ps] // ps).tolist(), g.start)
                   for g in shared_prefixes(tables, limits, ps, torch.device("cpu"), singles=singles)]
            assert got == by_page(tables, limits, ps, singles), (tables, limits, ps)
