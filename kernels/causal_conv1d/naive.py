"""Pure-torch reference for the depthwise causal short convolution of Gated DeltaNet (Qwen3-Next / Qwen3.5).

Channel c at time t sees its own last W inputs:

    y[c, t] = act( sum_{j=0}^{W-1} weight[c, j] * x[c, t - (W-1) + j] )

with the W-1 inputs before the first token taken from a carried `state` (zeros for a fresh sequence),
so a sequence can be processed in pieces (prefix cache hit, chunked prefill, decode) with identical
results. No bias, as in Qwen3.5. Math in fp32; outputs in x's dtype, states keep their dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "causal_conv1d_padded", "causal_conv1d_update", "causal_conv1d_update_slots",
           "causal_conv1d_update_depths", "causal_conv1d_update_depths_slots"]


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one sequence.

    Args:
        x: [C, T]
        weight: [C, W]
        initial_state: [C, W-1], the W-1 inputs preceding x (oldest first); zeros when None
        activation: "silu" / "swish" or None
    Returns:
        y: [C, T] in x's dtype
        final_state: [C, W-1] in initial_state's dtype (x's when None): the last W-1 inputs of
            initial_state ++ x, so it still holds part of initial_state when T < W-1
    """
    C, T = x.shape
    W = weight.shape[-1]
    if initial_state is None:
        state_dtype, initial_state = x.dtype, x.new_zeros(C, W - 1, dtype=torch.float32)
    else:
        state_dtype = initial_state.dtype
    # [C, W-1+T] fp32 (exact for bf16/fp16 inputs): the carried inputs act as the left padding
    xx = torch.cat([initial_state.float(), x.float()], dim=-1)
    if T == 0:  # conv1d rejects an input shorter than the kernel
        y = xx.new_empty(C, 0)
    else:
        y = F.conv1d(xx.unsqueeze(0), weight.float().unsqueeze(1), groups=C).squeeze(0)  # [C, T]
    # slice from an explicit start: xx[:, -(W-1):] would return everything when W == 1
    final_state = xx[:, xx.shape[-1] - (W - 1) :].to(state_dtype, copy=True)
    return _activate(y, activation).to(x.dtype), final_state


def causal_conv1d_padded(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor,
    lens: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """causal_conv1d of B sequences at once, right-padded to a common length (one conv call, not B).

    Args:
        x: [B, C, L]; sequence b's inputs are x[b, :, :lens[b]] (what follows is never read into
            its outputs or state: the conv is causal)
        weight: [C, W]
        initial_state: [B, C, W-1]
        lens: [B] int64, 1 <= lens[b] <= L
    Returns:
        y: [B, C, L] in x's dtype (columns past lens[b] are meaningless)
        final_state: [B, C, W-1] in initial_state's dtype, each at its own sequence's end
        xx: [B, C, W-1+L] fp32, state ++ inputs: the state after any n tokens of sequence b is
            xx[b, :, n : n + W-1]
    """
    B, C, L = x.shape
    W = weight.shape[-1]
    # time-major ([B, W-1+L, C], C contiguous), where the packed caller's x already is (a [B, L, C]
    # tensor seen transposed): a depthwise conv is then W multiply-adds along C. Channel-major,
    # the concatenation alone would be a transposing copy of the whole prompt.
    hist = x.new_empty(B, W - 1 + L, C, dtype=torch.float32)
    hist[:, : W - 1] = initial_state.transpose(1, 2)
    hist[:, W - 1:] = x.transpose(1, 2)
    wt = weight.float().t()                                                          # [W, C]
    y = hist[:, :L] * wt[0]
    for j in range(1, W):
        y.addcmul_(hist[:, j: j + L], wt[j])
    xx = hist.transpose(1, 2)                                                        # [B, C, W-1+L]
    idx = lens.to(x.device)[:, None] + torch.arange(W - 1, device=x.device)          # [B, W-1]
    final_state = xx.gather(2, idx[:, None, :].expand(B, C, W - 1)).to(initial_state.dtype)
    return _activate(y, activation).to(x.dtype).transpose(1, 2), final_state, xx


def causal_conv1d_update(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token for each of N sequences; `state` is shifted IN PLACE.

    Args:
        x: [N, C]
        state: [N, C, W-1], the previous W-1 inputs of each sequence (oldest first)
        weight: [C, W]
        activation: "silu" / "swish" or None
    Returns:
        y: [N, C] in x's dtype
    """
    window = torch.cat([state.float(), x.float().unsqueeze(-1)], dim=-1)  # [N, C, W] fp32
    y = (window * weight.float()).sum(-1)  # [N, C]
    state.copy_(window[..., 1:])  # shift: drop the oldest input (nothing to keep when W == 1)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_update_slots(
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """causal_conv1d_update on states that live in a pool: sequence n's state is pool[slots[n]]
    ([P, C, W-1], shifted IN PLACE there; slots distinct). Returns y [N, C] in x's dtype."""
    st = pool.index_select(0, slots)
    y = causal_conv1d_update(x, st, weight, activation)
    pool[slots] = st
    return y


def causal_conv1d_update_depths(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    counts: list[int],
    activation: str | None = "silu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A few consecutive tokens for each of N sequences, rows laid out depth-major (a decode step
    with jump-forward drafts): depth d's rows are the next counts[d] rows and belong to sequences
    0 .. counts[d]-1 (counts non-increasing, counts[0] = N). The same as causal_conv1d_update
    called depth by depth on state[:counts[d]], computed for all depths at once over each sequence's
    inputs (its state, then its rows).

    Args:
        x: [T, C], T = sum(counts)
        state: [N, C, W-1], shifted IN PLACE: each sequence ends after its last row
        weight: [C, W]
    Returns:
        y: [T, C] in x's dtype
        saved: saved[d] = the states of sequences [:counts[d+1]] after depth d, for every depth
            but the last (views of a new tensor, not of `state`)
    """
    N, C, Wm1 = state.shape
    D = len(counts)
    # each sequence's inputs oldest first, time-major so that every op below runs along C:
    # [N, W-1+D, C], the carried state then one column per depth (zeros past a sequence's last)
    hist = state.new_zeros(N, Wm1 + D, C, dtype=torch.float32)
    hist[:, :Wm1] = state.transpose(1, 2)
    offsets = [0]
    for d, n in enumerate(counts):
        hist[:n, Wm1 + d] = x[offsets[-1]: offsets[-1] + n]
        offsets.append(offsets[-1] + n)
    wt = weight.float().t()                                                 # [W, C]
    y = hist[:, :D] * wt[0]                                                 # [N, D, C]
    for j in range(1, Wm1 + 1):
        y.addcmul_(hist[:, j: j + D], wt[j])
    y = _activate(y, activation).to(x.dtype)
    out = torch.empty_like(x)
    for d, n in enumerate(counts):
        out[offsets[d]: offsets[d + 1]] = y[:n, d]
    saved = [hist[: counts[d + 1], d + 1: d + 1 + Wm1].transpose(1, 2) for d in range(D - 1)]
    # sequence i ran L_i = #{d: counts[d] > i} depths: its state is hist[i, L_i : L_i + W-1], so the
    # sequences of each run length (a contiguous range, counts being non-increasing) take one copy
    for d in range(D):
        lo = counts[d + 1] if d + 1 < D else 0
        if counts[d] > lo:
            state[lo: counts[d]] = hist[lo: counts[d], d + 1: d + 1 + Wm1].transpose(1, 2)
    return out, saved


def causal_conv1d_update_depths_slots(
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    counts: list[int],
    activation: str | None = "silu",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """causal_conv1d_update_depths on states in a pool: sequence i's state is pool[slots[i]]
    (slots: [counts[0]], distinct), shifted there. Returns y and saved as that function does."""
    st = pool.index_select(0, slots)
    out, saved = causal_conv1d_update_depths(x, st, weight, counts, activation)
    pool[slots] = st
    return out, saved
