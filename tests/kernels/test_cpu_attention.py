"""The CPU attention kernels (kernels/attention/cpu.py: cpu_decode.cpp, cpu_prefill.cpp) against their torch
forms: decode attention read in place in the KV pool, cascade decode (large groups by the prefill kernel, small
ones in place), many query rows over one K/V, extend and cascade prefill. `built`: conftest.py."""
from __future__ import annotations

import pytest
import torch

from radixflow.kernels import cpu_ext
from radixflow.kernels.attention import cascade as attn_cascade
from radixflow.kernels.attention import cpu as attn_cpu
from radixflow.kernels.attention import naive as attn_naive


def _needs_prefill_kernel(dtype: torch.dtype) -> None:
    """Skip where this CPU has no form of the prefill kernel for `dtype`."""
    ext = cpu_ext.get()
    if not (ext.attend_takes_bf16() if dtype == torch.bfloat16 else ext.attend_takes_fp32()):
        pytest.skip(f"this CPU has no {'AVX512-BF16' if dtype == torch.bfloat16 else 'AVX-512'}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (3, 1, 40), (2, 2, 24)])
def test_decode_attention_matches_the_reference(built, dtype, Hq, Hkv, D, monkeypatch):
    """One query per row over its slots, read in place: rows of 1, 63 and 500 slots in one batch,
    slots scattered over the pool, padding past each row's length that is never read (-1 here),
    GQA groups of 1, 2 and 3 heads, head sizes that are no multiple of 16."""
    gen = torch.Generator().manual_seed(D)
    kc, vc = (torch.randn(700, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    lens = [1, 63, 500, 7]
    table = torch.full((len(lens), max(lens)), -1, dtype=torch.int64)
    for n, L in enumerate(lens):
        table[n, :L] = torch.randperm(700, generator=gen)[:L]
    q = torch.randn(len(lens), Hq, D, generator=gen).to(dtype)
    want = attn_naive.decode_attention(q, kc, vc, table, torch.tensor(lens), D ** -0.5)
    with monkeypatch.context() as m:       # the kernel, never the reference
        m.setattr(attn_cpu.naive, "decode_attention", lambda *a, **k: pytest.fail("went to the reference"))
        got = attn_cpu.decode_attention(q, kc, vc, table, torch.tensor(lens), D ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # a table the kernel would read past is refused, as the reference refuses it
    with pytest.raises(RuntimeError, match="slots in a table"):
        attn_cpu.decode_attention(q, kc, vc, table, torch.tensor([1, 63, 501, 7]), D ** -0.5)
    bad = table.clone()
    bad[1, 0] = 700
    with pytest.raises(RuntimeError, match="outside the pool"):
        attn_cpu.decode_attention(q, kc, vc, bad, torch.tensor(lens), D ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_by_the_kernel_matches_the_reference(built, dtype, monkeypatch):
    """Own parts by the kernel (one of them empty: a row whose whole context is its group's prefix
    is attended to the prefix alone), each group's shared prefix merged in as in the torch form;
    a row in no group reads all of its slots."""
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D = 4, 2, 64
    kc, vc = (torch.randn(600, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    shared = torch.arange(100, 196)                      # 96 slots, contiguous: a view
    own_lens = [5, 0, 130, 1]                           # row 2 is in no group: all of its slots
    own = [torch.randperm(250, generator=gen)[:n] + 300 for n in own_lens]
    groups = [attn_cascade.SharedPrefix(seqs=[0, 1, 3], slots=shared, start=100)]
    q = torch.randn(4, Hq, D, generator=gen).to(dtype)
    table = torch.nn.utils.rnn.pad_sequence([o if len(o) else torch.zeros(1, dtype=torch.int64) for o in own],
                                            batch_first=True)
    full = [torch.cat([shared, o]) if i != 2 else o for i, o in enumerate(own)]
    want = attn_naive.decode_attention(q, kc, vc, torch.nn.utils.rnn.pad_sequence(full, batch_first=True),
                                       torch.tensor([len(f) for f in full]), D ** -0.5)
    with monkeypatch.context() as m:
        m.setattr(attn_cpu.cascade, "own_decode", lambda *a, **k: pytest.fail("went to the reference"))
        got = attn_cpu.cascade_decode(q, kc, vc, table, torch.tensor(own_lens), groups, D ** -0.5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # the torch form of cascade decode agrees too (where its own parts are not empty)
    rows = [0, 2, 3]
    ref = attn_cascade.cascade_decode(q[rows], kc, vc, table[rows], torch.tensor(own_lens)[rows],
                                      [attn_cascade.SharedPrefix(seqs=[0, 2], slots=shared, start=100)], D ** -0.5)
    torch.testing.assert_close(got[rows].float(), ref.float(), **tol)




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_reads_a_small_groups_prefix_in_place(built, dtype, monkeypatch):
    """A group of FEW_ROWS rows or fewer has its prefix read by the decode kernel in place (its
    slots scattered over the pool here), a larger one by attend_lse once for all its rows; both
    agree with reading every row's whole context."""
    gen = torch.Generator().manual_seed(9)
    Hq, Hkv, D = 4, 2, 64
    kc, vc = (torch.randn(2000, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    perm = torch.randperm(2000, generator=gen)
    big, small = torch.arange(100, 300), perm[:150]            # 6 rows share 200 slots, 2 rows 150
    big_rows, small_rows = list(range(6)), [6, 7]
    own_lens = [3, 9, 1, 0, 20, 7, 4, 0, 60]                  # row 8 is in no group
    own = [perm[200 + 100 * i:200 + 100 * i + n] for i, n in enumerate(own_lens)]
    groups = [attn_cascade.SharedPrefix(seqs=big_rows, slots=big, start=100),
              attn_cascade.SharedPrefix(seqs=small_rows, slots=small)]
    assert len(small_rows) <= attn_cpu.FEW_ROWS < len(big_rows)
    q = torch.randn(9, Hq, D, generator=gen).to(dtype)
    table = torch.nn.utils.rnn.pad_sequence([o if len(o) else torch.zeros(1, dtype=torch.int64) for o in own],
                                            batch_first=True)
    full = [torch.cat([big if i in big_rows else small, o]) if i < 8 else o for i, o in enumerate(own)]
    want = attn_naive.decode_attention(q, kc, vc, torch.nn.utils.rnn.pad_sequence(full, batch_first=True),
                                       torch.tensor([len(f) for f in full]), D ** -0.5)
    calls = []
    attend = attn_cpu.attend_lse
    monkeypatch.setattr(attn_cpu, "attend_lse", lambda q, *a, **k: calls.append(q.shape[0]) or attend(q, *a, **k))
    got = attn_cpu.cascade_decode(q, kc, vc, table, torch.tensor(own_lens), groups, D ** -0.5)
    assert calls == [len(big_rows)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


ATTEND = [(1, 1, None, 2), (5, 7, None, 1), (33, 100, "causal", 2), (70, 130, None, 4), (300, 300, "causal", 2),
          (40, 64, "causal", 4), (9, 200, "blind", 2)]


@pytest.mark.parametrize("T,S,mask,G", ATTEND)
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attend_by_the_kernel_matches_the_reference(built, T, S, mask, G, D, dtype, monkeypatch):
    """Many query rows over one K/V (cpu_prefill.cpp), against the fp32 reference of the same inputs:
    in bf16 within its output rounding, the LSE fp32-close; in fp32 within fp32 rounding. Keys past a
    64-key block's end (S of 1, 7, 100, 130, 200), no mask and causal masks, GQA groups of 1, 2 and
    4, q a strided view of a projection's output (as the layer hands it), K/V views of a pool.
    "blind": rows that see no key at all (position -1: o = 0, lse = -inf, as the reference's
    all-masked rows are not defined)."""
    _needs_prefill_kernel(dtype)
    gen = torch.Generator().manual_seed(T * S + D)
    Hkv = 2
    Hq = Hkv * G
    proj = torch.randn(T, Hq * D + 5, generator=gen).to(dtype)
    q = proj[:, :Hq * D].view(T, Hq, D)                                  # row stride Hq * D + 5
    pool = torch.randn(2, S + 20, Hkv, D, generator=gen).to(dtype)
    k, v = pool[0, 10:10 + S], pool[1, 10:10 + S]
    q_pos = None if mask is None else torch.arange(S - T, S)
    if mask == "blind":
        q_pos[:3] = -1
    with monkeypatch.context() as m:
        m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to the reference"))
        o, lse = attn_cpu.attend_lse(q, k, v, D ** -0.5, q_pos)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == q.shape and lse.shape == (T, Hq)
    seen = slice(3, None) if mask == "blind" else slice(None)
    ro, rlse = attn_cascade._attend_ref(q.float()[seen], k.float(), v.float(), D ** -0.5,
                                        None if q_pos is None else q_pos[seen])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o[seen], ro, **tol)
    torch.testing.assert_close(lse[seen], rlse, **(tol if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))
    if mask == "blind":
        assert torch.equal(o[:3], torch.zeros_like(o[:3])) and torch.isneginf(lse[:3]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_attention_by_the_kernel_matches_the_reference(built, dtype, monkeypatch):
    """extend_attention and cascade_prefill through the kernel, against their torch forms: a fresh
    sequence (square causal), one after a cached prefix, and a group of three sharing a prefix of
    pages scattered over the pool, with own parts of different lengths."""
    _needs_prefill_kernel(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D = 4, 2, 64
    kc, vc = (torch.randn(2000, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    perm = torch.randperm(2000, generator=gen)
    lens, prefix = [(0, 150), (90, 40)], []
    seq_slots, bounds, at, used = [], [], 0, 0
    for p, e in lens:
        seq_slots.append(perm[used:used + p + e])
        used += p + e
        bounds.append((at, at + e))
        at += e
        prefix.append(p)
    q = torch.randn(at, Hq, D, generator=gen).to(dtype)
    with monkeypatch.context() as m:
        m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to the reference"))
        got = attn_cpu.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    want = attn_naive.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    shared = perm[used:used + 300]
    own = [perm[used + 300 + 50 * i:used + 300 + 50 * i + n] for i, n in enumerate([10, 50, 1])]
    seq_slots = [torch.cat([shared, o]) for o in own]
    prefix = [300 + len(o) - e for o, e in zip(own, [4, 50, 1])]
    bounds = [(0, 4), (4, 54), (54, 55)]
    q = torch.randn(55, Hq, D, generator=gen).to(dtype)
    groups = [attn_cascade.SharedPrefix(seqs=[0, 1, 2], slots=shared)]
    with monkeypatch.context() as m:
        m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to the reference"))
        got = attn_cpu.cascade_prefill(q, kc, vc, bounds, seq_slots, prefix, groups, D ** -0.5)
    want = attn_naive.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_attention_under_a_sliding_window_matches_the_reference(built, dtype):
    """Mistral's window through cpu.extend_attention: the kernel takes what the window does not cut
    per token (one token; a context inside the window), the masked reference the rest."""
    _needs_prefill_kernel(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    gen = torch.Generator().manual_seed(13)
    Hq, Hkv, D, window = 4, 2, 64, 48
    kc, vc = (torch.randn(2000, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    perm = torch.randperm(2000, generator=gen)
    lens, prefix, seq_slots, bounds, at, used = [(0, 150), (90, 40), (300, 1), (10, 20)], [], [], [], 0, 0
    for p, e in lens:
        seq_slots.append(perm[used:used + p + e])
        used += p + e
        bounds.append((at, at + e))
        at += e
        prefix.append(p)
    q = torch.randn(at, Hq, D, generator=gen).to(dtype)
    got = attn_cpu.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5, window)
    want = attn_naive.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5, window)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_shared_prefix_is_read_where_it_lies_in_the_pool(built, dtype, monkeypatch):
    """A group's prefix scattered over the pool (no contiguous run: start -1) is read by the kernel
    through its slots, never gathered (SharedPrefix.kv), in cascade prefill and decode alike; the
    result is the gathered prefix's, and a slot outside the pool is a clear error."""
    _needs_prefill_kernel(dtype)
    gen = torch.Generator().manual_seed(21)
    Hq, Hkv, D = 4, 2, 64
    kc, vc = (torch.randn(3000, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(3000, generator=gen)[:700]
    g = attn_cascade.SharedPrefix(seqs=list(range(50)), slots=slots)
    q = torch.randn(50, Hq, D, generator=gen).to(dtype)
    with monkeypatch.context() as m:
        m.setattr(attn_cascade.SharedPrefix, "kv", lambda *a: pytest.fail("gathered"))
        o, lse = attn_cpu.attend_at(q, kc, vc, slots, D ** -0.5)
        own = torch.zeros(50, 1, dtype=torch.int64)
        dec = attn_cpu.cascade_decode(q, kc, vc, own, torch.zeros(50, dtype=torch.int64), [g], D ** -0.5)
    ro, rlse = attn_cascade._attend_ref(q.float(), kc[slots].float(), vc[slots].float(), D ** -0.5, None)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o, ro, **tol)
    torch.testing.assert_close(lse, rlse, **(tol if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)))
    torch.testing.assert_close(dec.float(), ro, **(tol if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))
    with pytest.raises(RuntimeError, match="outside"):
        attn_cpu.attend_at(q[:1], kc, vc, torch.tensor([5, 3000]), D ** -0.5)


@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (2, 2, 128)])
def test_a_group_prefills_in_one_pass_by_the_fp32_kernel(built, Hq, Hkv, D, monkeypatch):
    """cascade_prefill's groups by attend_cascade (fp32): two groups whose members are not in batch
    order, a sequence alone beside them, own parts with cached own tokens and own parts longer than
    the kernel's key blocks (64, 128), against the torch reference; the composition (own parts padded,
    merged) is not used, and a slot outside the pool is a clear error."""
    if not cpu_ext.get().attend_takes_fp32():
        pytest.skip("this CPU has no AVX-512")
    gen = torch.Generator().manual_seed(8)
    kc, vc = (torch.randn(4000, Hkv, D, generator=gen) for _ in range(2))
    perm = torch.randperm(4000, generator=gen)
    shared = [perm[:700], perm[700:1000]]
    # (group, cached own tokens, new tokens); group -1: alone (a 260-token prompt, fresh)
    seqs = [(0, 0, 100), (1, 5, 3), (0, 130, 70), (-1, 0, 260), (1, 0, 1), (0, 2, 1)]
    seq_slots, bounds, prefix, at, used = [], [], [], 0, 1000
    for grp, cached, new in seqs:
        own = perm[used:used + cached + new]
        used += cached + new
        seq_slots.append(own if grp < 0 else torch.cat([shared[grp], own]))
        prefix.append(len(seq_slots[-1]) - new)
        bounds.append((at, at + new))
        at += new
    groups = [attn_cascade.SharedPrefix(seqs=[5, 2, 0], slots=shared[0]),
              attn_cascade.SharedPrefix(seqs=[4, 1], slots=shared[1])]
    q = torch.randn(at, Hq, D, generator=gen)
    with monkeypatch.context() as m:
        m.setattr(attn_cascade, "_attend_padded", lambda *a, **k: pytest.fail("composed"))
        got = attn_cpu.cascade_prefill(q, kc, vc, bounds, seq_slots, prefix, groups, D ** -0.5)
    want = attn_naive.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    bad = [x.clone() for x in seq_slots]
    bad[0][-1] = 4000
    with pytest.raises(RuntimeError, match="outside"):
        attn_cpu.cascade_prefill(q, kc, vc, bounds, bad, prefix, groups, D ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_kept_scratch_carries_nothing_between_calls(built, dtype):
    """The prefill kernel packs K (and V) into scratch its thread keeps between calls: a large call,
    then a smaller one (the buffer holds the large one's keys past the small one's end), then the
    large one again, each match the reference and a repeated call is bit-identical."""
    _needs_prefill_kernel(dtype)
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D = 4, 2, 64
    kc, vc = (torch.randn(4000, Hkv, D, generator=gen).to(dtype) for _ in range(2))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    firsts = {}
    for T, S in ((20, 3000), (7, 70), (20, 3000), (7, 70)):
        slots = torch.randperm(4000, generator=torch.Generator().manual_seed(S))[:S]
        q = torch.randn(T, Hq, D, generator=torch.Generator().manual_seed(T)).to(dtype)
        o, lse = attn_cpu.attend_at(q, kc, vc, slots, D ** -0.5)
        ro, _ = attn_cascade._attend_ref(q.float(), kc[slots].float(), vc[slots].float(), D ** -0.5, None)
        torch.testing.assert_close(o, ro, **tol)
        if S in firsts:
            assert torch.equal(o, firsts[S][0]) and torch.equal(lse, firsts[S][1])
        firsts[S] = o, lse


def test_prefill_attention_the_kernel_does_not_take_goes_to_the_reference(built, monkeypatch):
    """A head size the kernel has no form for goes to the torch forms whole: a fresh prompt's
    extension to naive's causal op, which needs no mask, not to per-sequence masked calls."""
    gen = torch.Generator().manual_seed(4)
    for dtype, D in ((torch.float32, 40), (torch.bfloat16, 40)):
        kc, vc = (torch.randn(300, 2, D, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(50, 4, D, generator=gen).to(dtype)
        slots = torch.randperm(300, generator=gen)[:50]
        want = attn_naive.extend_attention(q, kc, vc, [(0, 50)], [slots], [0], D ** -0.5)
        with monkeypatch.context() as m:
            m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to per-sequence calls"))
            got = attn_cpu.extend_attention(q, kc, vc, [(0, 50)], [slots], [0], D ** -0.5)
        assert torch.equal(got, want)
