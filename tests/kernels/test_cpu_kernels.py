"""The C++ CPU kernels (kernels/cpu_ext.py) against their torch references: the DeltaNet ops of a
prefill batch, a decode step and a jump-forward step (rows by depth), in place in a state pool; the
layers' fused elementwise ops and the rotary embedding. Attention: test_cpu_attention.py; linear
layers: test_cpu_linear.py; the `built` fixture: conftest.py."""
from __future__ import annotations

import pytest
import torch

from radixflow.kernels import cpu_ext
from radixflow.kernels.causal_conv1d import cpu as conv_cpu
from radixflow.kernels.causal_conv1d import naive as conv_ref
from radixflow.kernels.causal_conv1d import packed as conv_packed_ref
from radixflow.kernels.elementwise import cpu as ew_cpu
from radixflow.kernels.elementwise import reference as ew_ref
from radixflow.kernels.gated_delta_rule import cpu as gdr_cpu
from radixflow.kernels.gated_delta_rule import naive as gdr_ref
from radixflow.kernels.gated_delta_rule import packed as packed_ref

DEPTHS = [[5], [3, 3, 3], [4, 2, 1], [6, 6, 2, 2, 1], [4, 4, 4, 3, 3, 2, 2, 1, 1]]


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
@pytest.mark.parametrize("W,C", [(2, 40), (4, 40), (4, 48)])
def test_conv_update_depths_match_the_reference(built, counts, W, C):
    """40 channels: the generic loop; width 4 and 48: whole 16-lane blocks, the AVX-512 form where
    the CPU has it. x a view with a row stride (the in-projection's output split), read as it lies."""
    T, N = sum(counts), counts[0]
    gen = torch.Generator().manual_seed(W)
    x, weight = torch.randn(T, C + 24, generator=gen)[:, 8:8 + C], torch.randn(C, W, generator=gen)
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
@pytest.mark.parametrize("C", [70, 96, 128])
def test_conv_prefill_matches_the_reference(built, bounds, taps, dtype, activation, C, monkeypatch):
    """x and out in the model's dtype, read and written by the kernel as they are (bf16 too), the
    SiLU fused; the rows of no sequence (a mixed step's decode rows: the last two) left alone.
    70 channels: the generic loop (a block of 64 and a rest); 96: whole 16-lane blocks, the
    AVX-512 form where the CPU has it; 128: its tasks of four blocks."""
    T, W = max(e for _, e in bounds) + 2, 4
    gen = torch.Generator().manual_seed(T)
    # x a view with a row stride, as the layer's split of its in-projection
    x, weight = torch.randn(T, C + 16, generator=gen).to(dtype)[:, 16:], torch.randn(C, W, generator=gen)
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
    # the residual stream's add and norm (x += r in place, then its norm), zero-centered or not; r a
    # view with row strides (a projection's output split)
    stream = torch.randn(T, 80, generator=gen).to(dtype)
    sums = []
    for zc in (False, True):
        want_sum, want = ew_ref.add_rms_norm(stream.clone(), proj[:, :80], w, 1e-6, zc)
        sums.append(want_sum)
        cases.append(("add_rms_norm", (stream.clone(), proj[:, :80], w, 1e-6, zc)))
        wants.append(want)
    with monkeypatch.context() as m:      # fp32 and bf16 rows: the kernel, never the reference
        for name in ("silu_mul", "rms_norm", "add_rms_norm", "gated_rms_norm"):
            m.setattr(ew_cpu.reference, name, lambda *a, **k: pytest.fail("went to the reference"))
        for (name, args), want in zip(cases, wants):
            got = getattr(ew_cpu, name)(*args)
            if name == "add_rms_norm":
                # the sum, in the stream's own tensor, is the reference's to the bit (one rounding)
                assert got[0] is args[0] and torch.equal(got[0], sums.pop(0))
                got = got[1]
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


def test_each_kind_of_cpu_gets_a_build_of_its_own(monkeypatch, tmp_path):
    """-march=native builds for the CPU that compiles: an environment shared with a machine whose CPU
    has other instruction sets keeps a second build instead of loading one that dies there (SIGILL)."""
    from radixflow.kernels import cpu_ext
    avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
    assert cpu_ext.cpu_signature(avx512) == cpu_ext.cpu_signature(avx512.replace("avx2 fma", "fma avx2"))
    assert cpu_ext.cpu_signature(avx512) != cpu_ext.cpu_signature(avx2)
    assert len(cpu_ext.cpu_signature()) == 12                     # this machine's, from /proc/cpuinfo
    monkeypatch.setattr(cpu_ext.sys, "prefix", str(tmp_path))
    dirs, signature = set(), cpu_ext.cpu_signature
    for info in (avx512, avx2):
        monkeypatch.setattr(cpu_ext, "cpu_signature", lambda info=info: signature(info))
        dirs.add(cpu_ext._build_dir())
    assert len(dirs) == 2 and all(d.startswith(str(tmp_path)) for d in dirs)
