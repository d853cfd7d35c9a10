"""The C++ CPU kernels (kernels/cpu_ext.py) against their torch references: the DeltaNet ops of a
prefill batch, a decode step and a jump-forward step (rows by depth), in place in a state pool; the
layers' fused elementwise ops; decode attention read in place in the KV pool."""
from __future__ import annotations

import pytest
import torch

from radixflow.kernels import cpu_ext
from radixflow.kernels.attention import cascade as attn_cascade
from radixflow.kernels.attention import cpu as attn_cpu
from radixflow.kernels.attention import naive as attn_naive
from radixflow.kernels.causal_conv1d import cpu as conv_cpu
from radixflow.kernels.causal_conv1d import naive as conv_ref
from radixflow.kernels.causal_conv1d import packed as conv_packed_ref
from radixflow.kernels.elementwise import cpu as ew_cpu
from radixflow.kernels.elementwise import reference as ew_ref
from radixflow.kernels.gated_delta_rule import cpu as gdr_cpu
from radixflow.kernels.gated_delta_rule import naive as gdr_ref
from radixflow.kernels.gated_delta_rule import packed as packed_ref

DEPTHS = [[5], [3, 3, 3], [4, 2, 1], [6, 6, 2, 2, 1], [4, 4, 4, 3, 3, 2, 2, 1, 1]]


@pytest.fixture(scope="module")
def built():
    if cpu_ext.wait(600) is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are needed)")


def inputs(T, Hk, Hv, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)     # noqa: E731
    return r(T, Hk, K), r(T, Hk, K), r(T, Hv, V), -torch.nn.functional.softplus(r(T, Hv)) * 2, r(T, Hv).sigmoid()


@pytest.mark.parametrize("counts", DEPTHS)
@pytest.mark.parametrize("keep", [True, False])
def test_gated_delta_rule_depths_match_the_reference(built, counts, keep):
    T, N = sum(counts), counts[0]
    q, k, v, g, beta = inputs(T, 2, 4, 32, 48, seed=len(counts))
    slots = torch.randperm(3 * N)[:N]
    pool = torch.randn(3 * N, 4, 32, 48)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, want_saved = gdr_ref.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, want_pool, slots, counts, keep=keep)
    got, got_saved = gdr_cpu.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, got_pool, slots, counts, keep=keep)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_pool, want_pool, atol=2e-5, rtol=2e-5)
    assert len(got_saved) == len(want_saved)
    for a, b in zip(got_saved, want_saved):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    others = torch.ones(3 * N, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(got_pool[others], pool[others])       # no other state touched


def test_gated_delta_rule_decode_matches_the_reference(built):
    q, k, v, g, beta = inputs(7, 2, 4, 64, 64, seed=3)
    slots = torch.tensor([9, 0, 4, 12, 2, 7, 5])
    pool = torch.randn(13, 4, 64, 64)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gdr_ref.gated_delta_rule_decode_slots(q.bfloat16(), k.bfloat16(), v, g, beta, want_pool, slots)
    got = gdr_cpu.gated_delta_rule_decode_slots(q.bfloat16(), k.bfloat16(), v, g, beta, got_pool, slots)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_pool, want_pool, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("counts", DEPTHS[1:3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_delta_rule_decode_reads_the_layers_views(built, counts, dtype, monkeypatch):
    """As the layer passes them (see the prefill's test): views of one row per token in the model's
    dtype, 2 qk heads for 4 value heads; read as they are, the output in that dtype."""
    T, N = sum(counts), counts[0]
    q, k, v, g, beta = inputs(T, 2, 4, 64, 64, seed=len(counts) + 7)
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), torch.zeros(T, 8)], 1).to(dtype)
    q, k, v, _ = mixed.split([128, 128, 256, 8], 1)
    q, k, v = q.view(T, 2, 64), k.view(T, 2, 64), v.view(T, 4, 64)
    slots = torch.randperm(3 * N)[:N]
    pool = torch.randn(3 * N, 4, 64, 64)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, want_saved = gdr_ref.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, want_pool, slots, counts)
    with monkeypatch.context() as m:
        m.setattr(gdr_cpu, "_direct", _no_copy)
        got, got_saved = gdr_cpu.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, got_pool, slots, counts)
    assert got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-4, rtol=1e-4)
    for a, b in zip(got_saved, want_saved, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("counts", DEPTHS)
@pytest.mark.parametrize("W", [2, 4])
def test_conv_update_depths_match_the_reference(built, counts, W):
    T, N, C = sum(counts), counts[0], 40
    gen = torch.Generator().manual_seed(W)
    x, weight = torch.randn(T, C, generator=gen), torch.randn(C, W, generator=gen)
    slots = torch.randperm(2 * N)[:N]
    pool = torch.randn(2 * N, C, W - 1, generator=gen)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, want_saved = conv_ref.causal_conv1d_update_depths_slots(x, want_pool, weight, slots, counts)
    got, got_saved = conv_cpu.causal_conv1d_update_depths_slots(x, got_pool, weight, slots, counts)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_pool, want_pool)
    assert len(got_saved) == len(want_saved)
    for a, b in zip(got_saved, want_saved):
        torch.testing.assert_close(a, b)
    y1 = conv_cpu.causal_conv1d_update_slots(x[:N], got_pool, weight, slots)       # one token each
    y2 = conv_ref.causal_conv1d_update_slots(x[:N], want_pool, weight, slots)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(got_pool, want_pool)


def test_pools_the_kernels_do_not_take_go_to_the_reference(built):
    """A bf16 state pool: the reference runs (the kernel reads fp32 states)."""
    q, k, v, g, beta = inputs(3, 1, 2, 16, 16, seed=5)
    pool = torch.randn(4, 2, 16, 16).bfloat16()
    slots = torch.tensor([3, 0, 1])
    want_pool = pool.clone()
    got = gdr_cpu.gated_delta_rule_decode_slots(q, k, v, g, beta, pool, slots)
    want = gdr_ref.gated_delta_rule_decode_slots(q, k, v, g, beta, want_pool, slots)
    assert torch.equal(got, want) and torch.equal(pool, want_pool)


# a packed prefill batch: sequences of other lengths, rows between them that belong to none (a
# mixed step's decode rows, left untouched), and checkpoint taps inside sequences
PREFILLS = [([(0, 150)], [[]]),
            ([(0, 40), (41, 120), (123, 130)], [[(16, 9)], [], [(2, 10), (5, 11)]]),
            ([(2, 66), (66, 130)], [[(64 - 1, 12)], [(1, 13)]])]


# (K, V): a head size without a template instance (the generic step), and the instantiated ones
HEADS = [(32, 48), (64, 64), (128, 128), (64, 128)]


@pytest.mark.parametrize("K,V", HEADS)
@pytest.mark.parametrize("bounds,taps", PREFILLS)
def test_gated_delta_rule_prefill_matches_the_reference(built, bounds, taps, K, V):
    T = max(e for _, e in bounds) + 2
    q, k, v, g, beta = inputs(T, 2, 4, K, V, seed=T)
    slots = [3, 0, 6][: len(bounds)]
    pool = torch.randn(14, 4, K, V)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.full((T, 4, V), 7.0), torch.full((T, 4, V), 7.0)
    packed_ref.gated_delta_rule_prefill_slots(q, k, v, g, beta, want, want_pool, bounds, slots, taps)
    gdr_cpu.gated_delta_rule_prefill_slots(q, k, v, g, beta, got, got_pool, bounds, slots, taps)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-4, rtol=1e-4)
    mine = torch.zeros(T, dtype=torch.bool)
    for s, e in bounds:
        mine[s:e] = True
    assert bool((got[~mine] == 7.0).all())
    # in bf16 the output is written through an fp32 buffer, at the same rows only
    got16 = torch.full((T, 4, V), 7.0, dtype=torch.bfloat16)
    gdr_cpu.gated_delta_rule_prefill_slots(q, k, v, g, beta, got16, pool.clone(), bounds, slots, taps)
    torch.testing.assert_close(got16.float(), want, atol=2e-2, rtol=2e-2)
    assert bool((got16[~mine] == 7.0).all())


def _no_copy(*views):
    """gdr_cpu._direct, checking that the kernel gets the layer's views themselves."""
    out = _direct(*views)
    assert all(a is b for a, b in zip(out, views)), "copied the layer's views"
    return out


_direct = gdr_cpu._direct


@pytest.mark.parametrize("bounds,taps", PREFILLS[1:])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_delta_rule_prefill_reads_the_layers_views(built, bounds, taps, dtype, monkeypatch):
    """As the layer passes them: q, k, v views of one row per token (the conv output split per
    head, row strides), in the model's dtype, at 2 qk heads for 4 value heads, o in that dtype.
    The kernel reads them as they are (no fp32 copies, no buffer for o)."""
    T, K, V = max(e for _, e in bounds) + 2, 64, 64
    q, k, v, g, beta = inputs(T, 2, 4, K, V, seed=T + 1)
    mixed = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), torch.zeros(T, 8)], 1).to(dtype)
    q, k, v, _ = mixed.split([2 * K, 2 * K, 4 * V, 8], 1)
    q, k, v = q.view(T, 2, K), k.view(T, 2, K), v.view(T, 4, V)
    slots = [3, 0, 6][: len(bounds)]
    pool = torch.randn(14, 4, K, V)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.full((T, 4, V), 7.0, dtype=dtype), torch.full((T, 4, V), 7.0, dtype=dtype)
    packed_ref.gated_delta_rule_prefill_slots(q, k, v, g, beta, want, want_pool, bounds, slots, taps)
    with monkeypatch.context() as m:
        m.setattr(gdr_cpu, "spans", lambda *a: pytest.fail("went through an fp32 buffer"))
        m.setattr(gdr_cpu, "_direct", _no_copy)
        m.setattr(gdr_cpu.packed, "gated_delta_rule_prefill_slots", lambda *a, **k: pytest.fail("went to the reference"))
        gdr_cpu.gated_delta_rule_prefill_slots(q, k, v, g, beta, got, got_pool, bounds, slots, taps)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-4, rtol=1e-4)
    mine = torch.zeros(T, dtype=torch.bool)
    for s, e in bounds:
        mine[s:e] = True
    assert bool((got[~mine] == 7.0).all())


@pytest.mark.parametrize("bounds,taps", PREFILLS)
@pytest.mark.parametrize("dtype,activation", [(torch.float32, "silu"), (torch.bfloat16, "silu"),
                                              (torch.float32, None)])
@pytest.mark.parametrize("C", [70, 96])
def test_conv_prefill_matches_the_reference(built, bounds, taps, dtype, activation, C, monkeypatch):
    """x and out in the model's dtype, read and written by the kernel as they are (bf16 too), the
    SiLU fused; the rows of no sequence (a mixed step's decode rows: the last two) left alone.
    70 channels: the generic loop (a block of 64 and a rest); 96: whole 16-lane blocks, the
    AVX-512 form where the CPU has it."""
    T, W = max(e for _, e in bounds) + 2, 4
    gen = torch.Generator().manual_seed(T)
    x, weight = torch.randn(T, C, generator=gen).to(dtype), torch.randn(C, W, generator=gen)
    slots = [3, 0, 6][: len(bounds)]
    pool = torch.randn(14, C, W - 1, generator=gen)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.full((T, C), 7.0, dtype=dtype), torch.full((T, C), 7.0, dtype=dtype)
    conv_packed_ref.causal_conv1d_prefill_slots(x, want, want_pool, weight, bounds, slots, taps, activation)
    with monkeypatch.context() as m:       # the kernel: no reference, no separate activation
        m.setattr(torch.nn.functional, "silu", lambda *a, **k: pytest.fail("a separate SiLU"))
        m.setattr(conv_cpu.packed, "causal_conv1d_prefill_slots", lambda *a, **k: pytest.fail("went to the reference"))
        conv_cpu.causal_conv1d_prefill_slots(x, got, got_pool, weight, bounds, slots, taps, activation)
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_pool, want_pool)


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_ops_match_the_reference(built, T, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(T)
    h = (torch.randn(T, 2 * 100, generator=gen) * 4).to(dtype)         # SiLU far into both tails; 100: 16-lane blocks and a rest
    # a projection's output split and viewed per head (row strides, no copy), as the layers pass them
    proj = torch.randn(T, 3 * 80, generator=gen).to(dtype)
    x2, w = proj[:, 80:160], (torch.randn(80, generator=gen) * 0.1).to(dtype)
    x3, z3 = proj[:, :80].reshape(T, 4, 20), proj[:, 160:].reshape(T, 4, 20)
    w3 = torch.randn(20, generator=gen).to(dtype)
    cases = [("silu_mul", (h,)), ("rms_norm", (x2, w, 1e-6, False)), ("rms_norm", (x2, w, 1e-6, True)),
             ("rms_norm", (x3, w3, 1e-6, True)), ("gated_rms_norm", (x3, z3, w3, 1e-6))]
    wants = [getattr(ew_ref, name)(*args) for name, args in cases]
    if dtype == torch.bfloat16 and not cpu_ext.get().silu_mul_takes_bf16():
        # silu_mul in bf16 is the 16-lane AVX512-BF16 form; torch's ops elsewhere (faster there)
        assert torch.equal(ew_cpu.silu_mul(h), wants[0])
        cases, wants = cases[1:], wants[1:]
    with monkeypatch.context() as m:      # fp32 and bf16 rows: the kernel, never the reference
        for name in ("silu_mul", "rms_norm", "gated_rms_norm"):
            m.setattr(ew_cpu.reference, name, lambda *a, **k: pytest.fail("went to the reference"))
        for (name, args), want in zip(cases, wants):
            got = getattr(ew_cpu, name)(*args)
            assert got.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want)
            else:
                # rounded to bf16 at the reference's points: equal but where an fp32 value sits
                # within an ulp of a rounding boundary (the SiLU's exp differs in its last bits)
                assert (got != want).float().mean() < 0.01, name
                torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)
    # what the kernel does not take goes to the reference: fp16, and a last dim that is not contiguous
    hh = h.half()
    assert torch.equal(ew_cpu.silu_mul(hh), ew_ref.silu_mul(hh))
    xt = torch.randn(80, T + 1, generator=gen).to(dtype)[:, :T].t()    # last-dim stride T + 1 (at T = 1 too)
    assert torch.equal(ew_cpu.rms_norm(xt, w, 1e-6), ew_ref.rms_norm(xt, w, 1e-6))


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



@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [16, 64])
def test_rotary_matches_the_reference_exactly(built, T, dtype, R, monkeypatch):
    """Rotary embedding by the kernel: bit-equal to the torch form (products and sum rounded where
    torch rounds them; no transcendental function on either side), on all of a head (R = D, Qwen3)
    and on a quarter of it (Qwen3.5's partial rotary), q a strided view of a projection's output,
    positions of a real table (Rotary's, gathered as the layer gathers them)."""
    from radixflow.services.executor.models.layers import Rotary
    gen = torch.Generator().manual_seed(T + R)
    rope = Rotary(R, 1e6, 4096)
    pos = torch.randint(0, 4096, (T,), generator=gen)
    proj = torch.randn(T, 6 * 64 + 3, generator=gen).to(dtype)
    proj[:, ::5] = 0.0                                                   # zeros: the sign of a zero sum
    x = proj[:, :6 * 64].view(T, 6, 64)
    cos, sin = rope._tables(pos, dtype)
    want = ew_ref.rotary(x, cos, sin)
    with monkeypatch.context() as m:
        m.setattr(ew_cpu.reference, "rotary", lambda *a, **k: pytest.fail("went to the reference"))
        got = ew_cpu.rotary(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32      # -0.0 and +0.0 apart too
    assert torch.equal(got.view(bits), want.view(bits))
    assert torch.equal(rope(x, pos, ew_cpu).view(bits), rope(x, pos).view(bits))   # the layer's two paths

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
def test_attend_by_the_kernel_matches_the_reference(built, T, S, mask, G, D, monkeypatch):
    """Many query rows over one K/V in bf16 (cpu_prefill.cpp), against the fp32 reference of the same
    bf16 inputs: within bf16 output rounding, the LSE fp32-close. Keys past a 64-key block's end
    (S of 1, 7, 100, 130, 200), no mask and causal masks, GQA groups of 1, 2 and 4, q a strided view
    of a projection's output (as the layer hands it), K/V views of a pool. "blind": rows that see no
    key at all (position -1: o = 0, lse = -inf, as the reference's all-masked rows are not defined)."""
    if not cpu_ext.get().attend_takes_bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(T * S + D)
    Hkv = 2
    Hq = Hkv * G
    proj = torch.randn(T, Hq * D + 5, generator=gen).bfloat16()
    q = proj[:, :Hq * D].view(T, Hq, D)                                  # row stride Hq * D + 5
    pool = torch.randn(2, S + 20, Hkv, D, generator=gen).bfloat16()
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
    torch.testing.assert_close(o[seen], ro, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse[seen], rlse, atol=1e-3, rtol=1e-3)
    if mask == "blind":
        assert torch.equal(o[:3], torch.zeros_like(o[:3])) and torch.isneginf(lse[:3]).all()


def test_prefill_attention_by_the_kernel_matches_the_reference(built, monkeypatch):
    """extend_attention and cascade_prefill in bf16 through the kernel, against their torch forms:
    a fresh sequence (square causal), one after a cached prefix, and a group of three sharing a
    prefix of pages scattered over the pool, with own parts of different lengths."""
    if not cpu_ext.get().attend_takes_bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D = 4, 2, 64
    kc, vc = (torch.randn(2000, Hkv, D, generator=gen).bfloat16() for _ in range(2))
    perm = torch.randperm(2000, generator=gen)
    lens, prefix = [(0, 150), (90, 40)], []
    seq_slots, bounds, at, used = [], [], 0, 0
    for p, e in lens:
        seq_slots.append(perm[used:used + p + e])
        used += p + e
        bounds.append((at, at + e))
        at += e
        prefix.append(p)
    q = torch.randn(at, Hq, D, generator=gen).bfloat16()
    with monkeypatch.context() as m:
        m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to the reference"))
        got = attn_cpu.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    want = attn_naive.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    shared = perm[used:used + 300]
    own = [perm[used + 300 + 50 * i:used + 300 + 50 * i + n] for i, n in enumerate([10, 50, 1])]
    seq_slots = [torch.cat([shared, o]) for o in own]
    prefix = [300 + len(o) - e for o, e in zip(own, [4, 50, 1])]
    bounds = [(0, 4), (4, 54), (54, 55)]
    q = torch.randn(55, Hq, D, generator=gen).bfloat16()
    groups = [attn_cascade.SharedPrefix(seqs=[0, 1, 2], slots=shared)]
    with monkeypatch.context() as m:
        m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to the reference"))
        got = attn_cpu.cascade_prefill(q, kc, vc, bounds, seq_slots, prefix, groups, D ** -0.5)
    want = attn_naive.extend_attention(q, kc, vc, bounds, seq_slots, prefix, D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_prefill_attention_the_kernel_does_not_take_goes_to_the_reference(built, monkeypatch):
    """fp32 (and a head size the kernel has no form for) goes to the torch forms whole: a fresh
    prompt's extension to naive's causal op, which needs no mask, not to per-sequence masked calls."""
    gen = torch.Generator().manual_seed(4)
    for dtype, D in ((torch.float32, 64), (torch.bfloat16, 40)):
        kc, vc = (torch.randn(300, 2, D, generator=gen).to(dtype) for _ in range(2))
        q = torch.randn(50, 4, D, generator=gen).to(dtype)
        slots = torch.randperm(300, generator=gen)[:50]
        want = attn_naive.extend_attention(q, kc, vc, [(0, 50)], [slots], [0], D ** -0.5)
        with monkeypatch.context() as m:
            m.setattr(attn_cpu.cascade, "attend_lse", lambda *a, **k: pytest.fail("went to per-sequence calls"))
            got = attn_cpu.extend_attention(q, kc, vc, [(0, 50)], [slots], [0], D ** -0.5)
        assert torch.equal(got, want)


LINEAR = [(1, 256, 64), (5, 256, 776), (6, 768, 256), (7, 64, 130), (97, 2, 3), (300, 256, 1536)]


@pytest.mark.parametrize("M,K,N", LINEAR)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_by_the_kernel_matches_the_reference(built, M, K, N, dtype, monkeypatch):
    """Linear layers by the kernel over packed weights (linear/cpu_gemm.cpp), x a strided view of a
    wider activation (as a layer's split hands it): against the product in fp64 within the dtype's
    rounding of the result, and against torch's matmul within one bf16 step (fp32: a few ulps);
    row counts around the 6-row micro-tile and the 96-row task, output widths past a 64-wide block's
    end. bf16's gate/up form is bit-equal to linear, then silu_mul (it rounds g and u where they
    would be rounded); fp32's is that, by definition. A row's result does not depend on the rows
    beside it (fp32: bit-equal alone and in the batch)."""
    from radixflow.kernels.linear import cpu as lin_cpu
    from radixflow.kernels.linear import reference as lin_ref
    ext = cpu_ext.get()
    if not (ext.linear_takes_bf16() if dtype == torch.bfloat16 else ext.linear_takes_fp32()):
        pytest.skip("this CPU has no AVX-512 (fp32), no AVX512-BF16 or has AMX (bf16)")
    gen = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K + 6, generator=gen).to(dtype)[:, 3:K + 3]
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    with monkeypatch.context() as m:
        m.setattr(lin_cpu.reference, "linear", lambda *a, **k: pytest.fail("went to the reference"))
        m.setattr(lin_cpu.reference, "linear_silu_mul", lambda *a, **k: pytest.fail("went to the reference"))
        got = lin_cpu.linear(x, w)
        fused = lin_cpu.linear_silu_mul(x, w) if N % 2 == 0 else None
    assert got.dtype == dtype and got.shape == (M, N)
    exact = (x.double() @ w.double().T).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, lin_ref.linear(x, w), atol=1e-5, rtol=1e-5)
        assert torch.equal(lin_cpu.linear(x[-1:], w), got[-1:])
        if fused is not None:
            assert torch.equal(fused, ew_cpu.silu_mul(got))
        return
    torch.testing.assert_close(got.float(), exact, atol=1e-3, rtol=2 ** -8)
    step = lin_ref.linear(x, w).float().abs().clamp_min(2 ** -100) * 2 ** -7
    assert ((got.float() - lin_ref.linear(x, w).float()).abs() <= step).all()
    if fused is not None:
        assert torch.equal(fused.view(torch.int16), ew_cpu.silu_mul(got).view(torch.int16))


def test_linear_packs_a_weight_once_and_again_when_it_changes(built):
    """The packed copy is kept on the weight: a second call reuses it, a weight written in place (a
    reload) is packed again; 3-D inputs keep their leading dims; fp64 goes to torch's matmul."""
    from radixflow.kernels.linear import cpu as lin_cpu
    if not cpu_ext.get().linear_takes_bf16():
        pytest.skip("this CPU has no AVX512-BF16, or has AMX (oneDNN's tile kernels serve)")
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Linear(128, 96, bias=False).weight.detach().bfloat16()
    x = torch.randn(2, 5, 128, generator=gen).bfloat16()
    first = lin_cpu.linear(x, w)
    packed = w._rf_packed[1]
    assert first.shape == (2, 5, 96)
    lin_cpu.linear(x, w)
    assert w._rf_packed[1] is packed
    w.mul_(2)
    again = lin_cpu.linear(x, w)
    assert w._rf_packed[1] is not packed and torch.equal(again, lin_cpu.reference.linear(x, w))
    xf, wf = x.double(), w.double()
    assert torch.equal(lin_cpu.linear(xf, wf), torch.nn.functional.linear(xf, wf)) and not hasattr(wf, "_rf_packed")
    # bf16 over a K past BF16_LONG_K: many rows go to oneDNN (the kernel does not block K), a few to the kernel
    K = lin_cpu.BF16_LONG_K + 2
    wl = torch.randn(64, K, generator=gen).bfloat16()
    lin_cpu.linear(torch.randn(lin_cpu.BF16_LONG_K_ROWS + 1, K, generator=gen).bfloat16(), wl)
    assert not hasattr(wl, "_rf_packed")
    lin_cpu.linear(torch.randn(40, K, generator=gen).bfloat16(), wl)
    assert hasattr(wl, "_rf_packed")
