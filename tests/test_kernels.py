"""Parity tests for the pure-torch reference kernels in radixflow.kernels.

Oracles: transformers' Qwen3.5 torch paths for the gated delta rule and the short conv, and explicit
dense definitions written out here for the conv and paged attention. fp32 everywhere unless stated;
atol 1e-5 is ~10-50x above the observed fp32 reordering noise of these sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from radixflow.kernels.attention import decode_attention, prefill_attention, write_kv
from radixflow.kernels.causal_conv1d import (causal_conv1d, causal_conv1d_padded, causal_conv1d_update,
                                             causal_conv1d_update_depths)
from radixflow.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule_decode,
    gated_delta_rule_decode_depths,
    recurrent_gated_delta_rule,
)

# the hub-kernel decorators keep the plain torch function under __wrapped__: always test against it
hf_chunk = getattr(hf.torch_chunk_gated_delta_rule, "__wrapped__", hf.torch_chunk_gated_delta_rule)
hf_recurrent = getattr(
    hf.torch_recurrent_gated_delta_rule, "__wrapped__", hf.torch_recurrent_gated_delta_rule
)
hf_conv = getattr(hf.causal_conv1d_fn, "__wrapped__", hf.causal_conv1d_fn)

ATOL = RTOL = 1e-5


def close(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------- gated delta rule


def gdr_inputs(B, T, Hk, Hv, K, V, seed=0, state=False, decay_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, Hv, V)
    # Qwen3.5 parametrisation: g = -exp(A_log) * softplus(a + dt_bias) < 0, beta = sigmoid(b)
    g = -decay_scale * r(Hv).exp() * F.softplus(r(B, T, Hv))
    beta = r(B, T, Hv).sigmoid()
    h0 = r(B, Hv, K, V) if state else None
    return q, k, v, g, beta, h0


def hf_run(fn, q, k, v, g, beta, h0, l2=True):
    return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("KV", [(64, 64), (32, 48)])
@pytest.mark.parametrize("with_state", [False, True])
def test_gdr_matches_transformers(T, KV, with_state):
    K, V = KV
    q, k, v, g, beta, h0 = gdr_inputs(2, T, 2, 4, K, V, seed=T, state=with_state)
    o_ref, s_ref = hf_run(hf_recurrent, q, k, v, g, beta, h0)
    o_hfc, s_hfc = hf_run(hf_chunk, q, k, v, g, beta, h0)
    o_rec, s_rec = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o_chk, s_chk = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert o_chk.shape == (2, T, 4, V) and s_chk.shape == (2, 4, K, V) and s_chk.dtype == torch.float32
    for o, s in [(o_rec, s_rec), (o_chk, s_chk), (o_hfc, s_hfc)]:
        close(o, o_ref)
        close(s, s_ref)
    close(o_chk, o_hfc)
    close(s_chk, s_hfc)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_gdr_chunk_sizes(chunk_size):
    q, k, v, g, beta, h0 = gdr_inputs(1, 150, 2, 4, 32, 48, seed=1, state=True)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    close(o, o_ref)
    close(s, s_ref)


def test_gdr_without_l2norm():
    q, k, v, g, beta, h0 = gdr_inputs(2, 100, 2, 4, 32, 48, seed=2, state=True)
    # without the in-kernel norm the caller must keep ||k|| ~ 1 or the delta rule diverges
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    o_ref, s_ref = hf_run(hf_recurrent, q, k, v, g, beta, h0, l2=False)
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=False)
        close(o, o_ref)
        close(s, s_ref)


@pytest.mark.parametrize("decay_scale", [0.0, 30.0])
def test_gdr_extreme_decay(decay_scale):
    # g == 0 (no forgetting) and g ~ -30/token (exp underflows to 0 inside a chunk): no inf/nan
    q, k, v, g, beta, h0 = gdr_inputs(1, 130, 2, 4, 32, 48, seed=3, state=True, decay_scale=decay_scale)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    close(o, o_ref)
    close(s, s_ref)


@pytest.mark.parametrize("split", [1, 37, 64, 130])
def test_gdr_split_equals_one_pass(split):
    # prefix caching: run a prefix, keep its state, run the suffix from it == one pass
    q, k, v, g, beta, h0 = gdr_inputs(2, 200, 2, 4, 32, 48, seed=4, state=True)
    o_full, s_full = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    a, b = (slice(0, split), slice(split, None))
    for first, second in [
        (chunk_gated_delta_rule, chunk_gated_delta_rule),
        (recurrent_gated_delta_rule, recurrent_gated_delta_rule),
        (chunk_gated_delta_rule, recurrent_gated_delta_rule),
    ]:
        o1, s1 = first(q[:, a], k[:, a], v[:, a], g[:, a], beta[:, a], initial_state=h0)
        s1_before = s1.clone()
        o2, s2 = second(q[:, b], k[:, b], v[:, b], g[:, b], beta[:, b], initial_state=s1)
        assert torch.equal(s1, s1_before)  # initial_state is never modified
        close(torch.cat([o1, o2], dim=1), o_full)
        close(s2, s_full)


def test_gdr_decode_matches_recurrent_step():
    q, k, v, g, beta, h0 = gdr_inputs(3, 1, 2, 4, 32, 48, seed=5, state=True)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    state = h0.clone()
    o = gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    assert o.shape == (3, 4, 48)
    close(o, o_ref[:, 0])
    close(state, s_ref)


def test_gdr_decode_in_place_on_pool_view_and_gathered_copy():
    q, k, v, g, beta, _ = gdr_inputs(3, 12, 2, 4, 32, 48, seed=6)
    pool = torch.randn(8, 4, 32, 48)
    idx = torch.tensor([5, 1, 6])
    # oracle: chunked prefill of the 12 tokens from the pool states
    o_ref, s_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx])
    o_ref_b, s_ref_b = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool[2:5])
    pool_a, pool_b = pool.clone(), pool.clone()
    for t in range(12):
        # (a) gather / decode / scatter back, as the executor does for scattered state slots
        st = pool_a[idx]
        o_a = gated_delta_rule_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], st)
        pool_a[idx] = st
        # (b) a contiguous view of the pool, updated in place
        view = pool_b[2:5]
        o_b = gated_delta_rule_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], view)
        close(o_a, o_ref[:, t])
        close(o_b, o_ref_b[:, t])
    close(pool_a[idx], s_ref)
    close(pool_b[2:5], s_ref_b)
    untouched = [i for i in range(8) if i not in (5, 1, 6)]
    assert torch.equal(pool_a[untouched], pool[untouched])


def test_gdr_bf16_inputs():
    q, k, v, g, beta, h0 = gdr_inputs(1, 100, 2, 4, 32, 48, seed=7, state=True)
    o32, s32 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    cast = [x.bfloat16() for x in (q, k, v, g, beta)]
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, s = fn(*cast, initial_state=h0)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        # loose: the inputs themselves were rounded to bf16 (~3 significant digits)
        close(o.float(), o32, atol=3e-2, rtol=3e-2)
        close(s, s32, atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------------- causal conv1d


def conv_oracle(x, weight, state=None, activation="silu"):
    """Explicit definition: y[c, t] = act(sum_j w[c, j] * (state ++ x)[c, t + j]); x [C, T]."""
    C, T = x.shape
    W = weight.shape[1]
    state = torch.zeros(C, W - 1) if state is None else state
    xx = torch.cat([state, x], dim=1)
    y = torch.stack([(xx[:, t : t + W] * weight).sum(1) for t in range(T)], dim=1)
    return (F.silu(y) if activation else y), xx[:, xx.shape[1] - (W - 1) :]


@pytest.mark.parametrize("T", [1, 2, 3, 5, 64, 200])
@pytest.mark.parametrize("W", [1, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_full_pass(T, W, with_state):
    gen = torch.Generator().manual_seed(T * 10 + W)
    C = 24
    x, w = torch.randn(C, T, generator=gen), torch.randn(C, W, generator=gen)
    s0 = torch.randn(C, W - 1, generator=gen) if with_state else None
    y, s = causal_conv1d(x, w, initial_state=s0)
    y_ref, s_ref = conv_oracle(x, w, s0)
    close(y, y_ref)
    assert torch.equal(s, s_ref)  # the state is a copy of inputs: exact
    if not with_state:
        close(y, hf_conv(x[None], w, activation="silu")[0])


def test_conv_padded_equals_one_call_per_sequence():
    """Right-padded sequences of lengths 1, 2, 5 and 9 in one call: each one's outputs, its final
    state, and its state after any n tokens (xx) are those of its own call."""
    gen = torch.Generator().manual_seed(5)
    C, W, lens = 12, 4, [1, 9, 2, 5]
    x, w = torch.randn(len(lens), C, 9, generator=gen), torch.randn(C, W, generator=gen)
    s0 = torch.randn(len(lens), C, W - 1, generator=gen)
    y, final, xx = causal_conv1d_padded(x, w, s0, torch.tensor(lens))
    for b, n in enumerate(lens):
        y_ref, s_ref = causal_conv1d(x[b, :, :n], w, initial_state=s0[b])
        close(y[b, :, :n], y_ref)
        assert torch.equal(final[b], s_ref)
        for m in range(1, n + 1):
            assert torch.equal(xx[b, :, m:m + W - 1], causal_conv1d(x[b, :, :m], w, initial_state=s0[b])[1])


@pytest.mark.parametrize("split", [1, 2, 3, 7, 40])
def test_conv_split_and_steps_equal_one_pass(split):
    gen = torch.Generator().manual_seed(split)
    N, C, T, W = 3, 16, 41, 4
    x, w = torch.randn(N, C, T, generator=gen), torch.randn(C, W, generator=gen)
    s0 = torch.randn(N, C, W - 1, generator=gen)
    for n in range(N):
        y_full, s_full = causal_conv1d(x[n], w, initial_state=s0[n])
        y1, s1 = causal_conv1d(x[n, :, :split], w, initial_state=s0[n])
        y2, s2 = causal_conv1d(x[n, :, split:], w, initial_state=s1)
        close(torch.cat([y1, y2], dim=1), y_full)
        assert torch.equal(s2, s_full)
    # step by step with the in-place update, batched over N, through a view of a bigger pool
    pool = torch.randn(N + 2, C, W - 1)
    pool[1 : N + 1] = s0
    ys = [causal_conv1d_update(x[:, :, t], pool[1 : N + 1], w) for t in range(T)]
    y_steps = torch.stack(ys, dim=-1)  # [N, C, T]
    for n in range(N):
        y_full, s_full = causal_conv1d(x[n], w, initial_state=s0[n])
        close(y_steps[n], y_full)
        assert torch.equal(pool[1 + n], s_full)


def test_conv_update_matches_transformers_and_no_activation():
    gen = torch.Generator().manual_seed(0)
    N, C, W = 4, 8, 4
    x, w = torch.randn(N, C, generator=gen), torch.randn(C, W, generator=gen)
    st = torch.randn(N, C, W - 1, generator=gen)
    st_hf = st.clone()
    hf_update = getattr(hf.causal_conv1d_update, "__wrapped__", hf.causal_conv1d_update)
    y_ref = hf_update(x[..., None], st_hf, w, activation="silu")[..., 0]
    y = causal_conv1d_update(x, st, w)
    close(y, y_ref)
    assert torch.equal(st, st_hf)
    y_lin, _ = causal_conv1d(x.T, w, activation=None)
    close(y_lin, conv_oracle(x.T, w, activation=None)[0])


# ----------------------------------------------------------------------------------- paged attention

PAGE, PAGES, HQ, HKV, D = 16, 64, 4, 2, 32


def page_slots(L, gen):
    """Slots of an L-token sequence on shuffled pages of the pool (a page table expanded to slots)."""
    pages = torch.randperm(PAGES, generator=gen)[: (L + PAGE - 1) // PAGE]
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:L]


def dense_attention(q, k, v, q_pos, scale, window: int = 0):
    """Explicit softmax attention. q [E, Hq, D] at absolute positions q_pos, k/v [L, Hkv, D] contiguous;
    with a sliding window, key j is seen by query i only if i - window < j."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, Hq, D]
    s = torch.einsum("ehd,lhd->hel", q, k) * scale
    j = torch.arange(k.shape[0])[None, None, :]
    hidden = j > q_pos[None, :, None]
    if window:
        hidden = hidden | (j <= q_pos[None, :, None] - window)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hel,lhd->ehd", s.softmax(-1), v)


@pytest.mark.parametrize("prefix,E", [(0, 1), (0, 37), (5, 1), (50, 37), (100, 200)])
def test_prefill_attention_paged_equals_dense(prefix, E):
    gen = torch.Generator().manual_seed(prefix + E)
    L = prefix + E
    # pool full of noise: anything read from a slot that is not the sequence's shows up
    k_cache, v_cache = (torch.randn(PAGES * PAGE, HKV, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(L, HKV, D, generator=gen) for _ in range(2))
    q = torch.randn(E, HQ, D, generator=gen)
    slots = page_slots(L, gen)
    write_kv(k_cache, v_cache, slots[:prefix], k[:prefix], v[:prefix])  # cached earlier
    write_kv(k_cache, v_cache, slots[prefix:], k[prefix:], v[prefix:])  # this step's tokens
    scale = D**-0.5
    o = prefill_attention(q, k_cache, v_cache, slots, prefix, scale)
    assert o.shape == (E, HQ, D)
    close(o, dense_attention(q, k, v, torch.arange(prefix, L), scale))


@pytest.mark.parametrize("prefix,E,window", [(0, 37, 8), (50, 37, 16), (60, 1, 16), (10, 5, 64), (100, 200, 33)])
def test_prefill_attention_under_a_sliding_window_equals_dense(prefix, E, window):
    """Mistral's window: fresh prompts longer than it, a chunk after a cached prefix, one token,
    a context inside the window (nothing hidden)."""
    gen = torch.Generator().manual_seed(prefix + E + window)
    L = prefix + E
    k_cache, v_cache = (torch.randn(PAGES * PAGE, HKV, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(L, HKV, D, generator=gen) for _ in range(2))
    q = torch.randn(E, HQ, D, generator=gen)
    slots = page_slots(L, gen)
    write_kv(k_cache, v_cache, slots, k, v)
    o = prefill_attention(q, k_cache, v_cache, slots, prefix, D**-0.5, window)
    close(o, dense_attention(q, k, v, torch.arange(prefix, L), D**-0.5, window))


def test_decode_under_a_sliding_window_reads_each_rows_last_slots():
    """ForwardBatch.windowed clips a padded slot table to each row's last `window` slots: decode
    attention over it equals dense attention under the window (rows shorter and longer than it)."""
    from radixflow.services.executor.forward_batch import ForwardBatch
    gen = torch.Generator().manual_seed(12)
    lens, window = [1, 7, 33, 100], 16
    k_cache, v_cache = (torch.randn(PAGES * PAGE, HKV, D, generator=gen) for _ in range(2))
    perm = torch.randperm(PAGES * PAGE, generator=gen)
    table = torch.full((len(lens), max(lens)), -1, dtype=torch.int64)
    kvs, start = [], 0
    for n, L in enumerate(lens):
        slots = perm[start: start + L]
        start += L
        k, v = (torch.randn(L, HKV, D, generator=gen) for _ in range(2))
        write_kv(k_cache, v_cache, slots, k, v)
        table[n, :L] = slots
        kvs.append((k, v))
    empty = torch.empty(0, dtype=torch.int64)
    fb = ForwardBatch(is_decode=True, input_ids=empty, positions=empty, out_slots=empty, prefix_lens=[],
                      extend_lens=[], seq_slots=[], state_slots=empty, logits_rows=empty, slot_table=table,
                      seq_lens=torch.tensor(lens))
    clipped, clipped_lens = fb.windowed(window)
    assert clipped.shape == (4, window) and clipped_lens.tolist() == [1, 7, 16, 16]
    q = torch.randn(len(lens), HQ, D, generator=gen)
    o = decode_attention(q, k_cache, v_cache, clipped, clipped_lens, 0.125)
    for n, (L, (k, v)) in enumerate(zip(lens, kvs)):
        close(o[n], dense_attention(q[n: n + 1], k, v, torch.tensor([L - 1]), 0.125, window)[0])


def test_decode_attention_padded_batch():
    gen = torch.Generator().manual_seed(11)
    lens = [1, 7, 33, 100]
    k_cache, v_cache = (torch.randn(PAGES * PAGE, HKV, D, generator=gen) for _ in range(2))
    # sequences share one pool: carve disjoint shuffled pages for them
    perm = torch.randperm(PAGES * PAGE, generator=gen)
    table = torch.full((len(lens), max(lens)), -1, dtype=torch.int64)  # -1 padding must never be read
    kvs, start = [], 0
    for n, L in enumerate(lens):
        slots = perm[start : start + L]
        start += L
        k, v = (torch.randn(L, HKV, D, generator=gen) for _ in range(2))
        write_kv(k_cache, v_cache, slots, k, v)
        table[n, :L] = slots
        kvs.append((k, v))
    q = torch.randn(len(lens), HQ, D, generator=gen)
    o = decode_attention(q, k_cache, v_cache, table, torch.tensor(lens), 0.125)
    for n, (L, (k, v)) in enumerate(zip(lens, kvs)):
        close(o[n], dense_attention(q[n : n + 1], k, v, torch.tensor([L - 1]), 0.125)[0])


def test_write_kv_and_low_precision_pool():
    k_cache, v_cache = (torch.zeros(32, HKV, D, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.tensor([9, 3, 30])
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots], k.bfloat16()) and torch.equal(v_cache[slots], v.bfloat16())
    mask = torch.ones(32, dtype=torch.bool)
    mask[slots] = False
    assert not k_cache[mask].any() and not v_cache[mask].any()
    q = torch.randn(2, HQ, D, dtype=torch.bfloat16)
    o = prefill_attention(q, k_cache, v_cache, slots, 1, D**-0.5)
    assert o.dtype == torch.bfloat16
    kf, vf = k_cache[slots].float(), v_cache[slots].float()
    ref = dense_attention(q.float(), kf, vf, torch.tensor([1, 2]), D**-0.5)
    close(o.float(), ref, atol=1e-2, rtol=1e-2)  # only the final bf16 rounding differs


# ------------------------------------------------------------ jump-forward steps: rows by depth

# counts[d]: how many sequences (the first ones) have a row at depth d; rows are depth-major
DEPTHS = [[3], [3, 3, 3], [4, 2, 1], [5, 5, 2, 2, 1], [4, 4, 4, 3, 3, 2, 2, 1, 1]]


@pytest.mark.parametrize("counts", DEPTHS)
@pytest.mark.parametrize("decay", [1.0, 30.0])
def test_gdr_decode_depths_equals_depth_by_depth(counts, decay):
    # all depths at once (the chunked form) against a decode step per depth; a strong decay too,
    # whose cumulative log decays would overflow the form's exp(G_i - G_j) above the diagonal
    T, N = sum(counts), counts[0]
    q, k, v, g, beta, _ = gdr_inputs(1, T, 2, 4, 32, 48, seed=11, decay_scale=decay)
    q, k, v, g, beta = q[0], k[0], v[0], g[0], beta[0]
    h0 = torch.randn(N, 4, 32, 48)
    ref_state, ref_o, ref_saved, s = h0.clone(), [], [], 0
    for d, n in enumerate(counts):
        ref_o.append(gated_delta_rule_decode(q[s:s + n], k[s:s + n], v[s:s + n], g[s:s + n], beta[s:s + n], ref_state[:n]))
        s += n
        if d + 1 < len(counts):
            ref_saved.append(ref_state[: counts[d + 1]].clone())
    state = h0.clone()
    o, saved = gated_delta_rule_decode_depths(q, k, v, g, beta, state, counts)
    close(o, torch.cat(ref_o))
    close(state, ref_state)
    assert len(saved) == len(ref_saved)
    for a, b in zip(saved, ref_saved):
        close(a, b)
    # in a pool, and without keeping the states between depths (no draft of the step can be undone)
    from radixflow.kernels.gated_delta_rule.naive import gated_delta_rule_decode_depths_slots
    slots = torch.randperm(2 * N)[:N]
    for keep in (True, False):
        pool = torch.randn(2 * N, 4, 32, 48)
        pool[slots] = h0
        untouched = pool.clone()
        o, saved = gated_delta_rule_decode_depths_slots(q, k, v, g, beta, pool, slots, counts, keep=keep)
        close(o, torch.cat(ref_o))
        close(pool[slots], ref_state)
        others = torch.ones(2 * N, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(pool[others], untouched[others])
        assert len(saved) == (len(ref_saved) if keep else 0)
        for a, b in zip(saved, ref_saved):
            close(a, b)


@pytest.mark.parametrize("counts", DEPTHS)
@pytest.mark.parametrize("W", [2, 4])
def test_conv_update_depths_equals_depth_by_depth(counts, W):
    T, N, C = sum(counts), counts[0], 6
    x, weight, h0 = torch.randn(T, C), torch.randn(C, W), torch.randn(N, C, W - 1)
    ref_state, ref_y, ref_saved, s = h0.clone(), [], [], 0
    for d, n in enumerate(counts):
        ref_y.append(causal_conv1d_update(x[s:s + n], ref_state[:n], weight))
        s += n
        if d + 1 < len(counts):
            ref_saved.append(ref_state[: counts[d + 1]].clone())
    state = h0.clone()
    y, saved = causal_conv1d_update_depths(x, state, weight, counts)
    close(y, torch.cat(ref_y))
    close(state, ref_state)
    assert len(saved) == len(ref_saved)
    for a, b in zip(saved, ref_saved):
        close(a, b)
