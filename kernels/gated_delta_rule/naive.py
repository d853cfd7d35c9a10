"""Pure-torch reference kernels for the gated delta rule (Gated DeltaNet, as used by Qwen3-Next / Qwen3.5).

Recurrence per value head, with state S of shape [K, V]:

    S'      = exp(g_t) * S_{t-1}                 # forget (g_t <= 0 is a log decay)
    delta_t = beta_t * (v_t - S'^T k_t)          # [V]: the part of v_t the state fails to predict
    S_t     = S' + k_t delta_t^T                 # rank-1 write
    o_t     = S_t^T q_t                          # [V]

q and k are L2-normalised (eps 1e-6) when `use_qk_l2norm`, and q is always scaled by K**-0.5.
Grouped heads: q/k have Hk heads, v/g/beta have Hv heads (Hv % Hk == 0); qk head h serves the
Hv/Hk consecutive v heads [h*G, (h+1)*G).

All math runs in fp32; outputs come back in q's dtype and states are fp32.
"""

from __future__ import annotations

import torch

__all__ = ["recurrent_gated_delta_rule", "chunk_gated_delta_rule", "gated_delta_rule_decode",
           "gated_delta_rule_decode_slots", "gated_delta_rule_decode_depths", "gated_delta_rule_decode_depths_slots",
           "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA / Qwen3.5 definition: eps inside the sqrt)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _group(num_k_heads: int, num_v_heads: int) -> int:
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"Hv={num_v_heads} must be a multiple of Hk={num_k_heads}")
    return num_v_heads // num_k_heads


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, use_qk_l2norm: bool):
    """fp32, optional L2 norm, q scaled by K**-0.5. Still at Hk heads: expanding later is G x cheaper."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hk*G, D]: each qk head serves `group` consecutive v heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _to_chunks(x: torch.Tensor, C: int, N: int, group: int = 1) -> torch.Tensor:
    """[B, T, H, D] (any dtype) -> fp32 [N, B*H*G, C, D], the tail chunk zero padded.

    One copy does the fp32 cast, the chunk-major transpose, the GQA head expansion (a broadcast
    source) and the padding, instead of four passes over memory.
    """
    B, T, H, D = x.shape
    buf = x.new_empty(N, B, H, group, C, D, dtype=torch.float32)
    dst = buf.permute(1, 0, 4, 2, 3, 5)  # [B, N, C, H, G, D] view
    src = x.unsqueeze(3).expand(B, T, H, group, D)
    full = T // C
    if full:
        dst[:, :full].copy_(src[:, : full * C].reshape(B, full, C, H, group, D))
    if full < N:
        # zero padded tokens: k = v = beta = g = 0 means "no write, no decay", see chunk_gated_delta_rule
        rem = T - full * C
        dst[:, full, rem:].zero_()
        dst[:, full, :rem].copy_(src[:, full * C :])
    return buf.view(N, B * H * group, C, D)


def _step(q, k, v, g, beta, state):
    """One recurrence step, fp32, heads already expanded; updates `state` in place.

    q, k: [N, H, K]; v: [N, H, V]; g, beta: [N, H]; state: [N, H, K, V] fp32. Returns o [N, H, V].
    """
    state.mul_(g.exp()[..., None, None])
    kv_mem = (k.unsqueeze(-2) @ state).squeeze(-2)  # [N, H, V] = S^T k
    delta = (v - kv_mem) * beta.unsqueeze(-1)  # [N, H, V]
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))  # rank-1 write k delta^T
    return (q.unsqueeze(-2) @ state).squeeze(-2)  # [N, H, V]


def _decode_step(q, k, v, g, beta, state, new=None):
    """_step arranged for fewer passes over the state (what decode is made of at a small batch):
    both reads, S^T q and S^T k, in one batched matmul over the old state; the output from them
    (S_t = e^g S + k delta^T, so o = e^g S^T q + (q.k) delta); the write as one scale and one
    rank-1 update. The new state goes into `new` ([N, H, K, V], contiguous), or into `state` in
    place when None; `state` must be contiguous.
    """
    N, H, K = k.shape
    V = v.shape[-1]
    eg = g.exp()                                                                  # [N, H]
    S = state.view(N * H, K, V)
    m = torch.bmm(torch.stack([q, k], dim=-2).view(N * H, 2, K), S).view(N, H, 2, V)
    m = m * eg[..., None, None]
    delta = (v - m[:, :, 1]) * beta[..., None]                                    # [N, H, V]
    o = m[:, :, 0] + (q * k).sum(-1, keepdim=True) * delta
    if new is None:
        new = state.mul_(eg[..., None, None])
    else:
        torch.mul(state, eg[..., None, None], out=new)
    new.view(N * H, K, V).baddbmm_(k.reshape(N * H, K, 1), delta.reshape(N * H, 1, V))
    return o


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token for each of N sequences; `state` is updated IN PLACE.

    Args:
        q, k: [N, Hk, K]
        v: [N, Hv, V]
        g, beta: [N, Hv] (g is the log decay, <= 0)
        state: [N, Hv, K, V], fp32 (a gathered copy or a view of the state pool)
    Returns:
        o: [N, Hv, V] in q's dtype
    """
    out_dtype = q.dtype
    group = _group(k.shape[-2], v.shape[-2])
    q, k = _prepare_qk(q, k, use_qk_l2norm)
    q, k = _expand_heads(q, group), _expand_heads(k, group)  # [N, Hv, K]
    if state.dtype == torch.float32 and state.is_contiguous():
        o = _decode_step(q, k, v.float(), g.float(), beta.float(), state)
    else:
        # keep the math in fp32 even for a low-precision pool, then write back
        work = state.float().contiguous()
        o = _decode_step(q, k, v.float(), g.float(), beta.float(), work)
        state.copy_(work)
    return o.to(out_dtype)


def gated_delta_rule_decode_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """gated_delta_rule_decode on states that live in a pool: sequence n's state is
    pool[slots[n]], read and written back there (slots distinct).

    Args:
        q, k: [N, Hk, K];  v: [N, Hv, V];  g, beta: [N, Hv]
        pool: [P, Hv, K, V], updated IN PLACE at `slots` ([N] int64)
    Returns:
        o: [N, Hv, V] in q's dtype
    """
    st = pool.index_select(0, slots)                   # a gathered copy (index_select: faster than [] on a CPU)
    o = gated_delta_rule_decode(q, k, v, g, beta, st, use_qk_l2norm)
    pool[slots] = st
    return o


def gated_delta_rule_decode_depths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    counts: list[int],
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A few consecutive tokens for each of N sequences, rows laid out depth-major (a decode step
    with jump-forward drafts): depth d's rows are the next counts[d] rows and belong to sequences
    0 .. counts[d]-1 (counts non-increasing, counts[0] = N). The same as gated_delta_rule_decode
    called depth by depth on state[:counts[d]], with q/k normalized and heads expanded once.

    Args:
        q, k: [T, Hk, K];  v: [T, Hv, V];  g, beta: [T, Hv];  T = sum(counts)
        state: [N, Hv, K, V] fp32, updated IN PLACE: each sequence ends after its last row
    Returns:
        o: [T, Hv, V] in q's dtype
        saved: saved[d] = the states of sequences [:counts[d+1]] after depth d (copies), for
            every depth but the last: what undoing a rejected draft tail restores
    """
    return _decode_depths(q, k, v, g, beta, state, counts, use_qk_l2norm, keep=True)


def gated_delta_rule_decode_depths_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    counts: list[int],
    use_qk_l2norm: bool = True,
    keep: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """gated_delta_rule_decode_depths on states in a pool: sequence i's state is pool[slots[i]]
    (slots: [counts[0]], distinct), updated there. Returns o and saved as that function does;
    with keep=False (no draft of the step can be undone) saved is [] and the depths run in place."""
    st = pool.index_select(0, slots)
    o, saved = _decode_depths(q, k, v, g, beta, st, counts, use_qk_l2norm, keep)
    pool[slots] = st
    return o, saved


def _decode_depths(q, k, v, g, beta, state: torch.Tensor, counts: list[int], use_qk_l2norm: bool,
                   keep: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """gated_delta_rule_decode_depths: each depth updates its sequences' states (a prefix of
    `state`) in place; with `keep`, the states of the sequences that go on to the next depth are
    copied out after each depth (a copy of the few that go on, where a new tensor per depth for
    every sequence of the depth cost twice the time at a batch of 16 with drafts in 3)."""
    out_dtype = q.dtype
    group = _group(k.shape[-2], v.shape[-2])
    q, k = _prepare_qk(q, k, use_qk_l2norm)
    q, k = _expand_heads(q, group), _expand_heads(k, group)
    v, g, beta = v.float(), g.float(), beta.float()
    work = state if state.dtype == torch.float32 and state.is_contiguous() else state.float().contiguous()
    o = torch.empty_like(v)
    saved, s = [], 0
    for d, n in enumerate(counts):
        o[s:s + n] = _decode_step(q[s:s + n], k[s:s + n], v[s:s + n], g[s:s + n], beta[s:s + n], work[:n])
        s += n
        if keep and d + 1 < len(counts):
            saved.append(work[: counts[d + 1]].clone())
    if work is not state:
        state.copy_(work)
    return o.to(out_dtype), saved


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (the ground-truth definition).

    Args:
        q, k: [B, T, Hk, K]
        v: [B, T, Hv, V]
        g, beta: [B, T, Hv]
        initial_state: [B, Hv, K, V] or None (zeros); not modified
    Returns:
        o: [B, T, Hv, V] in q's dtype
        final_state: [B, Hv, K, V] fp32
    """
    B, T, Hv, V = v.shape
    K = k.shape[-1]
    out_dtype = q.dtype
    group = _group(k.shape[-2], Hv)
    q, k = _prepare_qk(q, k, use_qk_l2norm)
    q, k = _expand_heads(q, group), _expand_heads(k, group)  # [B, T, Hv, K]
    vf, gf, bf = v.float(), g.float(), beta.float()
    if initial_state is None:
        state = q.new_zeros(B, Hv, K, V)
    else:
        state = initial_state.to(device=q.device, dtype=torch.float32, copy=True)  # never touch the caller's
    o = vf.new_empty(B, T, Hv, V)
    for t in range(T):
        o[:, t] = _step(q[:, t], k[:, t], vf[:, t], gf[:, t], bf[:, t], state)
    return o.to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) gated delta rule; same semantics as `recurrent_gated_delta_rule`.

    Inside a chunk of C tokens, with gamma_t = cumsum(g)_t (log decay since the chunk start) and
    S the state entering the chunk, unrolling the recurrence gives (u_t = delta_t):

        S_t = e^{gamma_t} S + sum_{i<=t} e^{gamma_t - gamma_i} k_i u_i^T
        (I + A) U = beta*V - (beta*e^gamma*K) S,   A_ti = beta_t e^{gamma_t - gamma_i} k_t.k_i  (i < t)

    so U = U0 - W S with U0 = (I+A)^-1 beta V and W = (I+A)^-1 beta e^gamma K: one unit-lower
    triangular solve for all chunks at once. With P = (Q K^T) * decay mask (diagonal included):

        O      = (e^gamma Q) S + P U
        S_next = e^{gamma_C} S + (e^{gamma_C - gamma} K)^T U

    Everything independent of S is batched over all chunks up front; the sequential scan over chunks
    is four in-place batched matmuls per chunk. Exponents are only ever of gamma_t - gamma_i with
    i <= t (or of gamma itself), all <= 0, so nothing overflows however strong the decay.

    Args:
        q, k: [B, T, Hk, K]
        v: [B, T, Hv, V]
        g, beta: [B, T, Hv]
        initial_state: [B, Hv, K, V] or None (zeros); not modified
        chunk_size: C
    Returns:
        o: [B, T, Hv, V] in q's dtype
        final_state: [B, Hv, K, V] fp32
    """
    B, T, Hv, V = v.shape
    K = k.shape[-1]
    C = chunk_size
    out_dtype = q.dtype
    group = _group(k.shape[-2], Hv)
    q, k = _prepare_qk(q, k, use_qk_l2norm)

    # Chunk-major layout [N, B*Hv, C, D] so each scan step is one contiguous bmm over (B, Hv).
    # The tail is zero padded: padded tokens have k = v = 0, beta = 0, g = 0 (decay 1), so they
    # write nothing and decay nothing; the final state is exact and their outputs are dropped.
    N = (T + C - 1) // C
    BH = B * Hv
    q, k, vf = _to_chunks(q, C, N, group), _to_chunks(k, C, N, group), _to_chunks(v, C, N)
    gamma = _to_chunks(g.unsqueeze(-1), C, N).squeeze(-1).cumsum_(-1)  # [N, BH, C]
    bf = _to_chunks(beta.unsqueeze(-1), C, N)  # [N, BH, C, 1]
    q3, k3 = q.view(N * BH, C, K), k.view(N * BH, C, K)  # bmm views: transposes need no copy

    # decay[t, i] = exp(gamma_t - gamma_i) for i <= t, 0 above the diagonal (masked before exp: no inf)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()  # [N, BH, C, C]

    # unit lower-triangular system I + A; A strictly lower (tril drops the diagonal beta k.k term)
    lower = torch.bmm(k3, k3.transpose(1, 2)).view(N, BH, C, C).mul_(decay).mul_(bf).tril_(-1)
    lower.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    # Explicit inverse (like FLA): solving against the identity is cheaper than against the
    # V + K right-hand sides, and the two products below are fast bmm.
    eye = torch.eye(C, dtype=lower.dtype, device=lower.device).expand_as(lower)
    t_inv = torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)  # [N, BH, C, C]
    eg = gamma.exp().unsqueeze(-1)  # [N, BH, C, 1]
    u = t_inv @ vf.mul_(bf)  # U0 [N, BH, C, V], turned into U in place by the scan
    w = t_inv @ (k * (bf * eg))  # W [N, BH, C, K]

    p = torch.bmm(q3, k3.transpose(1, 2)).view(N, BH, C, C).mul_(decay)  # [N, BH, C, C]
    qg = q.mul_(eg)  # [N, BH, C, K]: e^gamma Q (q is our own fp32 copy)
    g_last = gamma[..., -1:]  # [N, BH, 1]
    kd_t = (k * (g_last - gamma).exp().unsqueeze(-1)).transpose(-1, -2)  # [N, BH, K, C]
    chunk_decay = g_last.exp().unsqueeze(-1)  # [N, BH, 1, 1]

    if initial_state is None:
        state = q.new_zeros(BH, K, V)
    else:
        # our own copy: updated in place below, the caller's tensor is never touched or aliased
        state = initial_state.to(device=q.device, dtype=torch.float32, copy=True).reshape(BH, K, V)
    out = q.new_empty(N, BH, C, V)
    for n in range(N):
        un = u[n].baddbmm_(w[n], state, alpha=-1.0)  # U = U0 - W S  [BH, C, V]
        torch.bmm(qg[n], state, out=out[n])  # inter-chunk: read of the entering state
        out[n].baddbmm_(p[n], un)  # intra-chunk
        state.mul_(chunk_decay[n]).baddbmm_(kd_t[n], un)  # S <- e^{gamma_C} S + Kd^T U

    o = out.reshape(N, B, Hv, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, Hv, V)[:, :T]
    return o.to(out_dtype), state.reshape(B, Hv, K, V)
