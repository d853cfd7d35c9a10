"""Every Triton kernel against its torch reference, on awkward sizes (issue 12): outputs and the
pool/state contents after, under Triton's interpreter on a CPU (conftest sets TRITON_INTERPRET=1),
on the device where RADIXFLOW_TEST_DEVICE=cuda."""
from __future__ import annotations

import os

import pytest
import torch

from radixflow.kernels.attention import cascade as cascade_ref
from radixflow.kernels.attention import naive as attn_ref
from radixflow.kernels.attention import triton_extend
from radixflow.kernels.attention.triton_decode import decode_attention, decode_attention_lse
from radixflow.kernels.attention.triton_write import write_kv
from radixflow.kernels.causal_conv1d import naive as conv_ref
from radixflow.kernels.causal_conv1d.packed import causal_conv1d_prefill_slots as conv_prefill_ref
from radixflow.kernels.causal_conv1d.triton_prefill import causal_conv1d_prefill_slots
from radixflow.kernels.causal_conv1d.triton_update import causal_conv1d_update_depths_slots, causal_conv1d_update_slots
from radixflow.kernels.dispatch import pick
from radixflow.kernels.gated_delta_rule import naive as gdr_ref
from radixflow.kernels.gated_delta_rule.packed import gated_delta_rule_prefill_slots as gdr_prefill_ref
from radixflow.kernels.gated_delta_rule.triton_decode import (gated_delta_rule_decode_depths_slots,
                                                              gated_delta_rule_decode_slots)
from radixflow.kernels.gated_delta_rule.triton_prefill import gated_delta_rule_prefill_slots

DEV = torch.device(os.environ.get("RADIXFLOW_TEST_DEVICE", "cpu"))


def _table(lens: list[int], num_pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Slot tables as the executor builds them: each sequence's pages scattered over the pool,
    expanded to token slots, padded with -1 past its length."""
    pages = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), max(lens)), -1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // page_size)
        own = pages[used:used + k]
        used += k
        table[i, :n] = (own[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
    return table.to(DEV)


@pytest.mark.parametrize("lens,hq,hkv,d,page_size", [
    ([1, 63, 500], 4, 2, 64, 16),      # lengths 1 / 63 / 500 in one batch
    ([37, 5], 6, 2, 24, 3),            # G = 3, a head dim and a page size that divide nothing evenly
    ([130], 2, 2, 100, 7),             # no GQA, D = 100
    ([1], 8, 1, 16, 1),                # one key, all heads on one kv head
])
def test_decode_attention_matches_reference(lens, hq, hkv, d, page_size):
    gen = torch.Generator().manual_seed(len(lens) * 100 + d)
    num_pages = sum(-(-n // page_size) for n in lens) + 5
    S = num_pages * page_size
    k_cache = torch.randn(S, hkv, d, generator=gen).to(DEV)
    v_cache = torch.randn(S, hkv, d, generator=gen).to(DEV)
    q = torch.randn(len(lens), hq, d, generator=gen).to(DEV)
    table, seq_lens = _table(lens, num_pages, page_size, gen), torch.tensor(lens, device=DEV)
    want = attn_ref.decode_attention(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
    got, lse = decode_attention_lse(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the lse is what a cascade merges with: check it against the scores themselves
    for i, n in enumerate(lens):
        k = k_cache[table[i, :n]].float().repeat_interleave(hq // hkv, dim=1)     # [n, Hq, D]
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * d ** -0.5
        torch.testing.assert_close(lse[i], torch.logsumexp(s, dim=-1), atol=1e-5, rtol=1e-5)


def test_decode_attention_bf16_pool():
    gen = torch.Generator().manual_seed(7)
    lens, hq, hkv, d, ps = [300, 17, 1], 4, 2, 64, 16
    num_pages = sum(-(-n // ps) for n in lens)
    k_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    v_cache = torch.randn(num_pages * ps, hkv, d, generator=gen).to(DEV, torch.bfloat16)
    q = torch.randn(len(lens), hq, d, generator=gen).to(DEV, torch.bfloat16)
    table, seq_lens = _table(lens, num_pages, ps, gen), torch.tensor(lens, device=DEV)
    want = attn_ref.decode_attention(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
    got = decode_attention(q, k_cache, v_cache, table, seq_lens, d ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _packed(specs: list[tuple[int, int]], num_pages: int, page_size: int, hq: int, hkv: int, d: int, gen,
            shared: dict[int, int] | None = None):
    """A packed prefill batch: sequence i has prefix specs[i][0] cached and specs[i][1] new tokens on
    pages scattered over the pool; shared {i: n}: sequence i's first n slots are sequence 0's."""
    pages = torch.randperm(num_pages, generator=gen)
    k_cache = torch.randn(num_pages * page_size, hkv, d, generator=gen).to(DEV)
    v_cache = torch.randn(num_pages * page_size, hkv, d, generator=gen).to(DEV)
    seq_slots, bounds, used, row = [], [], 0, 0
    for p, e in specs:
        k = -(-(p + e) // page_size)
        seq_slots.append((pages[used:used + k, None] * page_size + torch.arange(page_size)).flatten()[:p + e].to(DEV))
        used += k
        bounds.append((row, row + e))
        row += e
    for i, n in (shared or {}).items():
        seq_slots[i] = torch.cat([seq_slots[0][:n], seq_slots[i][n:]])
    q = torch.randn(row, hq, d, generator=gen).to(DEV)
    return q, k_cache, v_cache, bounds, seq_slots, [p for p, _ in specs]


@pytest.mark.parametrize("specs,hq,hkv,d,page_size", [
    ([(0, 1), (0, 63), (0, 500)], 4, 2, 64, 16),          # empty prefixes, lengths 1 / 63 / 500
    ([(40, 63), (0, 5), (100, 1), (7, 30)], 6, 2, 24, 3),  # cached prefixes; G = 3, D = 24, pages of 3
    ([(130, 17)], 2, 2, 100, 7),
])
def test_extend_attention_matches_reference(specs, hq, hkv, d, page_size):
    gen = torch.Generator().manual_seed(sum(e for _, e in specs) + d)
    num_pages = sum(-(-(p + e) // page_size) for p, e in specs) + 3
    q, kc, vc, bounds, seq_slots, prefix_lens = _packed(specs, num_pages, page_size, hq, hkv, d, gen)
    want = attn_ref.extend_attention(q, kc, vc, bounds, seq_slots, prefix_lens, d ** -0.5)
    got = triton_extend.extend_attention(q, kc, vc, bounds, seq_slots, prefix_lens, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 8, 40])
def test_extend_attention_under_a_sliding_window_matches_reference(window):
    """Mistral's window: chunks after cached prefixes longer and shorter than it, a fresh prompt
    across it, one token."""
    gen = torch.Generator().manual_seed(window)
    specs = [(40, 63), (0, 50), (100, 1), (7, 30)]
    num_pages = sum(-(-(p + e) // 16) for p, e in specs) + 3
    q, kc, vc, bounds, seq_slots, prefix_lens = _packed(specs, num_pages, 16, 4, 2, 32, gen)
    want = attn_ref.extend_attention(q, kc, vc, bounds, seq_slots, prefix_lens, 32 ** -0.5, window)
    got = triton_extend.extend_attention(q, kc, vc, bounds, seq_slots, prefix_lens, 32 ** -0.5, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(want, attn_ref.extend_attention(q, kc, vc, bounds, seq_slots, prefix_lens, 32 ** -0.5))


def test_cascade_prefill_matches_reference():
    """A prefix shared by part of the batch (sequences 0, 2, 3 share 48 tokens; 1 and 4 do not)."""
    gen = torch.Generator().manual_seed(5)
    specs = [(60, 20), (0, 33), (50, 1), (90, 63), (10, 4)]
    q, kc, vc, bounds, seq_slots, prefix_lens = _packed(specs, 200, 16, 4, 2, 40, gen, shared={2: 48, 3: 48})
    groups = [cascade_ref.SharedPrefix(seqs=[0, 2, 3], slots=seq_slots[0][:48])]
    want = cascade_ref.cascade_prefill(q, kc, vc, bounds, seq_slots, prefix_lens, groups, 40 ** -0.5)
    got = triton_extend.cascade_prefill(q, kc, vc, bounds, seq_slots, prefix_lens, groups, 40 ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    plain = attn_ref.extend_attention(q, kc, vc, bounds, seq_slots, prefix_lens, 40 ** -0.5)
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=1e-5)      # and the cascade is exact


def test_cascade_decode_matches_reference():
    """Two groups and a sequence alone; own parts of lengths 1 to 130."""
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d, S = 8, 2, 32, 3000
    k_cache, v_cache = torch.randn(S, hkv, d, generator=gen).to(DEV), torch.randn(S, hkv, d, generator=gen).to(DEV)
    perm = torch.randperm(S, generator=gen).to(DEV)
    own_lens = [1, 17, 130, 5, 64, 2]
    own = [perm[200 + 200 * i: 200 + 200 * i + n] for i, n in enumerate(own_lens)]
    groups = [cascade_ref.SharedPrefix(seqs=[0, 2, 3], slots=perm[:70]),
              cascade_ref.SharedPrefix(seqs=[1, 5], slots=perm[70:71])]
    q = torch.randn(len(own_lens), hq, d, generator=gen).to(DEV)
    table, lens = torch.nn.utils.rnn.pad_sequence(own, batch_first=True), torch.tensor(own_lens, device=DEV)
    want = cascade_ref.cascade_decode(q, k_cache, v_cache, table, lens, groups, d ** -0.5)
    got = triton_extend.cascade_decode(q, k_cache, v_cache, table, lens, groups, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    S, T, H, D = 50, 13, 3, 20
    k = torch.randn(T, H, 2 * D, generator=gen)[..., :D].to(DEV)       # a strided view, as after a split
    v = torch.randn(T, H, D, generator=gen).to(DEV)
    slots = torch.randperm(S, generator=gen)[:T].to(DEV)
    pools = [torch.zeros(S, H, D, dtype=dtype, device=DEV) for _ in range(4)]
    attn_ref.write_kv(pools[0], pools[1], slots, k, v)
    write_kv(pools[2], pools[3], slots, k, v)
    if dtype == torch.float32 or DEV.type == "cuda":
        assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    else:   # the interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest, as torch): one ulp
        torch.testing.assert_close(pools[2], pools[0], atol=0, rtol=2 ** -7)
        torch.testing.assert_close(pools[3], pools[1], atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("n,hk,hv,dk,dv,l2", [(3, 2, 4, 64, 64, True), (5, 1, 3, 24, 100, True), (1, 2, 2, 16, 40, False)])
def test_gated_delta_rule_decode_matches_reference(n, hk, hv, dk, dv, l2):
    gen = torch.Generator().manual_seed(n * 10 + dv)
    P = n + 4
    q, k = torch.randn(n, hk, dk, generator=gen).to(DEV), torch.randn(n, hk, dk, generator=gen).to(DEV)
    v = torch.randn(n, hv, dv, generator=gen).to(DEV)
    g = -torch.rand(n, hv, generator=gen).to(DEV)
    beta = torch.rand(n, hv, generator=gen).to(DEV)
    pool = torch.randn(P, hv, dk, dv, generator=gen).to(DEV)
    slots = torch.randperm(P, generator=gen)[:n].to(DEV)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gdr_ref.gated_delta_rule_decode_slots(q, k, v, g, beta, want_pool, slots, use_qk_l2norm=l2)
    got = gated_delta_rule_decode_slots(q, k, v, g, beta, got_pool, slots, use_qk_l2norm=l2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-5, rtol=1e-5)    # other slots untouched too


@pytest.mark.parametrize("n,c,w,silu", [(3, 100, 4, True), (2, 256, 2, True), (4, 33, 4, False)])
def test_conv_update_matches_reference(n, c, w, silu):
    gen = torch.Generator().manual_seed(n * c + w)
    P = n + 3
    x = torch.randn(n, c, generator=gen).to(DEV)
    weight = torch.randn(c, w, generator=gen).to(DEV)
    pool = torch.randn(P, c, w - 1, generator=gen).to(DEV)
    slots = torch.randperm(P, generator=gen)[:n].to(DEV)
    act = "silu" if silu else None
    want_pool, got_pool = pool.clone(), pool.clone()
    want = conv_ref.causal_conv1d_update_slots(x, want_pool, weight, slots, act)
    got = causal_conv1d_update_slots(x, got_pool, weight, slots, act)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_pool, want_pool)


@pytest.mark.parametrize("counts", [[3, 2, 1], [4], [2, 2, 2], [5, 1, 1]])
def test_decode_depths_match_reference(counts):
    """A decode step with jump-forward drafts (rows depth-major, sequence i runs the depths with
    counts[d] > i): outputs, final states and the states saved after each depth but the last."""
    gen = torch.Generator().manual_seed(sum(counts) * 10 + len(counts))
    T, N = sum(counts), counts[0]
    P = N + 3
    hk, hv, dk, dv, C, W = 1, 2, 24, 40, 100, 4
    q, k = torch.randn(T, hk, dk, generator=gen).to(DEV), torch.randn(T, hk, dk, generator=gen).to(DEV)
    v = torch.randn(T, hv, dv, generator=gen).to(DEV)
    g, beta = (-torch.rand(T, hv, generator=gen) * 0.3).to(DEV), torch.rand(T, hv, generator=gen).to(DEV)
    pool = (torch.randn(P, hv, dk, dv, generator=gen) * 0.1).to(DEV)
    slots = torch.randperm(P, generator=gen)[:N].to(DEV)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, want_saved = gdr_ref.gated_delta_rule_decode_depths_slots(q, k, v, g, beta, want_pool, slots, counts)
    got, got_saved = gated_delta_rule_decode_depths_slots(q, k, v, g, beta, got_pool, slots, counts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-5, rtol=1e-5)
    assert len(got_saved) == len(want_saved) == len(counts) - 1
    for a, b in zip(got_saved, want_saved):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    x, weight = torch.randn(T, C, generator=gen).to(DEV), torch.randn(C, W, generator=gen).to(DEV)
    cpool = torch.randn(P, C, W - 1, generator=gen).to(DEV)
    want_c, got_c = cpool.clone(), cpool.clone()
    want, want_saved = conv_ref.causal_conv1d_update_depths_slots(x, want_c, weight, slots, counts)
    got, got_saved = causal_conv1d_update_depths_slots(x, got_c, weight, slots, counts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_c, want_c) and len(got_saved) == len(want_saved)
    for a, b in zip(got_saved, want_saved):
        assert torch.equal(a, b)


# prefill batches: (length, taps as token counts); lengths 1 / 63 / 200, a tap at 1 and one just
# before the end, sequences of unequal and of similar lengths (the reference's padded call). The
# first goes through the chunked kernel in rounds cut at the taps, the second (all under a chunk)
# through the recurrent one
PREFILL = [
    [(1, []), (63, [16, 62]), (200, [1, 64, 128])],
    [(40, [5]), (44, []), (41, [40])],
]


def _prefill_layout(seqs, P_extra: int, gen):
    bounds, row = [], 0
    for n, _ in seqs:
        bounds.append((row, row + n))
        row += n
    perm = torch.randperm(len(seqs) + sum(len(t) for _, t in seqs) + P_extra, generator=gen).tolist()
    slots = perm[:len(seqs)]
    rest = iter(perm[len(seqs):])
    taps = [[(n, next(rest)) for n in t] for _, t in seqs]
    return bounds, row, slots, taps


@pytest.mark.parametrize("seqs", PREFILL)
def test_gated_delta_rule_prefill_matches_reference(seqs):
    gen = torch.Generator().manual_seed(len(seqs) * 7 + seqs[0][0])
    hk, hv, dk, dv = 1, 2, 24, 40
    bounds, T, slots, taps = _prefill_layout(seqs, 2, gen)
    P = len(seqs) + sum(len(t) for _, t in seqs) + 2
    q, k = torch.randn(T, hk, dk, generator=gen).to(DEV), torch.randn(T, hk, dk, generator=gen).to(DEV)
    v = torch.randn(T, hv, dv, generator=gen).to(DEV)
    g = (-torch.rand(T, hv, generator=gen) * 0.3).to(DEV)
    beta = torch.rand(T, hv, generator=gen).to(DEV)
    pool = torch.randn(P, hv, dk, dv, generator=gen).to(DEV) * 0.1
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.zeros(T, hv, dv, device=DEV), torch.zeros(T, hv, dv, device=DEV)
    gdr_prefill_ref(q, k, v, g, beta, want, want_pool, bounds, slots, taps)
    gated_delta_rule_prefill_slots(q, k, v, g, beta, got, got_pool, bounds, slots, taps)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-4, rtol=1e-4)   # final states, taps, the rest


@pytest.mark.parametrize("lens", [[1, 63, 200], [64, 65, 128]])
def test_chunked_gated_delta_rule_matches_reference(lens):
    """The chunked kernel alone: sequences ending inside, at and just past a 64-token chunk."""
    from radixflow.kernels.gated_delta_rule.triton_chunk import chunk_gated_delta_rule_slots
    gen = torch.Generator().manual_seed(sum(lens))
    seqs = [(n, []) for n in lens]
    bounds, T, slots, taps = _prefill_layout(seqs, 1, gen)
    hk, hv, dk, dv = 2, 4, 16, 24
    q, k = torch.randn(T, hk, dk, generator=gen).to(DEV), torch.randn(T, hk, dk, generator=gen).to(DEV)
    v = torch.randn(T, hv, dv, generator=gen).to(DEV)
    g, beta = (-torch.rand(T, hv, generator=gen)).to(DEV), torch.rand(T, hv, generator=gen).to(DEV)
    pool = (torch.randn(len(lens) + 1, hv, dk, dv, generator=gen) * 0.1).to(DEV)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.zeros(T, hv, dv, device=DEV), torch.zeros(T, hv, dv, device=DEV)
    gdr_prefill_ref(q, k, v, g, beta, want, want_pool, bounds, slots, taps)
    chunk_gated_delta_rule_slots(q, k, v, g, beta, got, got_pool, bounds, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_pool, want_pool, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seqs", PREFILL + [[(2, [1]), (3, [])]])        # shorter than the window too
def test_conv_prefill_matches_reference(seqs):
    gen = torch.Generator().manual_seed(len(seqs) * 3 + seqs[0][0])
    C, W = 100, 4
    bounds, T, slots, taps = _prefill_layout(seqs, 1, gen)
    P = len(seqs) + sum(len(t) for _, t in seqs) + 1
    x = torch.randn(T, C, generator=gen).to(DEV)
    weight = torch.randn(C, W, generator=gen).to(DEV)
    pool = torch.randn(P, C, W - 1, generator=gen).to(DEV)
    want_pool, got_pool = pool.clone(), pool.clone()
    want, got = torch.zeros(T, C, device=DEV), torch.zeros(T, C, device=DEV)
    conv_prefill_ref(x, want, want_pool, weight, bounds, slots, taps)
    causal_conv1d_prefill_slots(x, got, got_pool, weight, bounds, slots, taps)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_pool, want_pool)


def test_dispatch_choice(monkeypatch):
    monkeypatch.delenv("RADIXFLOW_KERNELS", raising=False)
    assert pick(torch.device("cpu"), "auto").name == "cpu"
    assert pick(torch.device("cpu"), "torch").name == "torch"
    if os.environ.get("TRITON_INTERPRET") == "1":                       # conftest, on a CPU
        assert pick(torch.device("cpu"), "triton").name == "triton"
    if DEV.type == "cuda":
        assert pick(DEV, "auto").name == "triton"
    monkeypatch.setenv("RADIXFLOW_KERNELS", "torch")
    assert pick(torch.device("cpu"), "triton").name == "torch"          # the environment overrides
    monkeypatch.setenv("RADIXFLOW_KERNELS", "fast")
    with pytest.raises(ValueError, match="one of auto, torch, cpu, triton"):
        pick(torch.device("cpu"))
    monkeypatch.delenv("RADIXFLOW_KERNELS")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need a CUDA device"):
        pick(torch.device("cpu"), "triton")


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_engine_greedy_tokens_same_with_kernels(models, name):
    """The executor with the Triton kernels (write_kv, extend, decode and cascade attention, the
    DeltaNet and conv decode steps in place) produces the reference path's greedy tokens: sequences
    of different lengths decoding together, one long enough for several split-K programs, two
    sharing a preamble, two more prefilling over it once it is cached (cascade decode and prefill)."""
    import random

    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.shared.messages import ExecRequest, SamplingParams
    def ids(seed: int, n: int) -> list[int]:
        return [random.Random(seed).randrange(3, 8000) for _ in range(n)]
    # the hybrid model's DeltaNet kernels are slow in the interpreter: shorter prompts, one of them
    # past a 64-token chunk (the chunked prefill), the rest under it (the recurrent one)
    dense = name == "tiny-dense"
    preamble = ids(1, 64 if dense else 16)

    def req(rid: str, p: list[int]) -> ExecRequest:
        return ExecRequest(rid=rid, input_ids=p, eos_token_ids=[2],
                           sampling=SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    first = [req("short", ids(5, 5)), req("mid", ids(70, 40 if dense else 20)),
             req("long", ids(300, 300 if dense else 70)),
             req("agent-a", preamble + ids(2, 9)), req("agent-b", preamble + ids(3, 20))]
    # after the first step the preamble is cached: these two prefill over it together (a cascade prefill)
    later = [req("agent-c", preamble + ids(4, 12)), req("agent-d", preamble + ids(6, 40 if dense else 16))]
    outs = {}
    for kernels in ("torch", "triton"):
        e = Engine(EngineConfig(model=models[name], device=str(DEV), page_size=16, max_total_tokens=4096,
                                kernels=kernels, burst_gap_s=0, overlap=False, warmup_tokens=8))
        assert e.runner.kernels.name == kernels
        for r in first:
            e.add(r)
        out: dict[str, list[int]] = {}
        step = 0
        while e.has_work():
            if step == 1:
                for r in later:
                    e.add(r)
            for _, o in e.step():
                out.setdefault(o.rid, []).extend(o.token_ids)
            step += 1
        st = e.pages.stats()
        assert st["requests_held"] == 0 and st["kv_pages_private"] == 0
        outs[kernels] = out
    assert outs["triton"] == outs["torch"] and len(outs["torch"]) == 7
    assert all(len(v) == 4 for v in outs["torch"].values())


def test_jump_forward_greedy_tokens_same_with_kernels(models):
    """Constrained requests with jump-forward drafts on the hybrid model: the draft rows run the
    depth kernels (DeltaNet and conv, states saved per depth for undoing rejected tails); the greedy
    tokens equal the reference path's, and drafts were made and kept."""
    import json
    import random

    from radixflow.services.executor.engine import Engine, EngineConfig
    from radixflow.services.grammar.backends import make
    from radixflow.shared.messages import ExecRequest, SamplingParams
    model = models["tiny-hybrid"]
    backend = make("xgrammar", model)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "kind": {"enum": ["alphabetical", "numerical"]},
                                               "count": {"type": "integer"}},
              "required": ["name", "kind", "count"], "additionalProperties": False}
    raw = backend.compile("json_schema", json.dumps(schema)).raw
    outs, kept = {}, {}
    for kernels in ("torch", "triton"):
        e = Engine(EngineConfig(model=model, device=str(DEV), page_size=16, max_total_tokens=4096, kernels=kernels,
                                jump_forward=4, burst_gap_s=0, overlap=False, warmup_tokens=8))
        for i in range(2):
            rng = random.Random(i)
            e.add(ExecRequest(rid=f"j{i}", input_ids=[rng.randrange(3, 4000) for _ in range(6 + 3 * i)], eos_token_ids=[0, 2],
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=12)), backend.load(raw))
        out: dict[str, list[int]] = {}
        while e.has_work():
            for _, o in e.step():
                assert not o.error, o.error
                out.setdefault(o.rid, []).extend(o.token_ids)
        outs[kernels], kept[kernels] = out, (e.runner.drafted, e.runner.kept)
    assert outs["triton"] == outs["torch"] and len(outs["torch"]) == 2
    assert kept["triton"] == kept["torch"] and kept["torch"][1] > 0
