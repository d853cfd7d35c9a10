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

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_update_depths"]


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
    called depth by depth on state[:counts[d]], as one convolution over each sequence's window.

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
    D, dev = len(counts), x.device
    # row r (depth-major) is sequence i at depth d: it sits at i * D + d of the [N, D] grid
    at = torch.tensor([i * D + d for d, n in enumerate(counts) for i in range(n)], device=dev)
    grid = torch.zeros(N * D, C, dtype=torch.float32, device=dev)
    grid[at] = x.float()
    window = torch.cat([state.float(), grid.view(N, D, C).transpose(1, 2)], dim=-1)   # [N, C, W-1+D]
    y = F.conv1d(window, weight.float().unsqueeze(1), groups=C)                       # [N, C, D]
    out = _activate(y, activation).transpose(1, 2).reshape(N * D, C)[at].to(x.dtype)
    saved = [window[: counts[d + 1], :, d + 1: d + 1 + Wm1] for d in range(D - 1)]
    # sequence i ran L_i = #{d: counts[d] > i} depths: its state is window[i, :, L_i : L_i + W-1]
    if counts[-1] == N:
        state.copy_(window[..., D:])
    else:
        last = torch.tensor([sum(1 for n in counts if n > i) for i in range(N)], device=dev)
        idx = (last[:, None] + torch.arange(Wm1, device=dev))[:, None, :].expand(N, C, Wm1)
        state.copy_(window.gather(-1, idx))
    return out, saved
