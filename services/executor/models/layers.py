"""Small building blocks shared by every model family."""
from __future__ import annotations

import math

import torch
from torch import nn

from radixflow.kernels.elementwise import reference as _ref
from radixflow.kernels.linear import reference as _linear


class RMSNorm(nn.Module):
    """RMSNorm, computed in fp32. Qwen3.5 stores zero-centered weights and scales by (1 + w)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        """ops: the runner's kernels (dispatch.Kernels), whose rms_norm may be fused; else torch's
        (kernels/elementwise/reference.py, which also says where bf16 casts, as transformers)."""
        return (ops or _ref).rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add(self, x: torch.Tensor, r: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x += r (in place: x is the residual stream) and the sum's norm, in one op (add_rms_norm)."""
        return (ops or _ref).add_rms_norm(x, r, self.weight, self.eps, self.zero_centered)


class GatedRMSNorm(nn.Module):
    """norm(x) * w * silu(z): the output norm of a Gated DeltaNet head."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor, ops=None) -> torch.Tensor:
        return (ops or _ref).gated_rms_norm(x, z, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        """ops: the runner's kernels, whose linear layers may take gate/up and SiLU in one pass."""
        ops = ops or _linear
        return ops.linear(ops.linear_silu_mul(x, self.gate_up.weight), self.down.weight)


def inv_freq(rotary_dim: int, theta: float, rope_type: str = "default", scaling: dict | None = None,
             device: torch.device | None = None) -> torch.Tensor:
    """The rotary frequencies, [rotary_dim / 2], as the checkpoint's rope type scales them.

    linear: every frequency divided by `factor` (positions stretched). llama3 (Llama 3.1 / 3.2):
    wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those shorter than ... / high_freq_factor kept, and the band between blended linearly
    in the wavelength's inverse."""
    base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))
    sc = scaling or {}
    if rope_type == "linear":
        return base / sc["factor"]
    if rope_type == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old / lo, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, blended, scaled)
    if rope_type == "yarn":
        # YaRN: frequencies that turn fewer than beta_slow times over the original context are
        # interpolated (divided by factor), those turning more than beta_fast times kept, a linear
        # ramp over the dims between
        factor, old = sc["factor"], sc["original_max_position_embeddings"]

        def dim_of(turns: float) -> float:
            return rotary_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))
        lo, hi = dim_of(sc.get("beta_fast", 32.0)), dim_of(sc.get("beta_slow", 1.0))
        if sc.get("truncate", 1.0):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float, device=device) - lo) / (hi - lo)).clamp(0, 1)
        return base / factor * ramp + base * (1 - ramp)
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    return base


def attention_factor(rope_type: str, scaling: dict | None = None) -> float:
    """What cos and sin are multiplied by: 1, except under YaRN (0.1 ln(factor) + 1 unless the
    config names it, or the ratio of two such scales with mscale / mscale_all_dim)."""
    sc = scaling or {}
    if rope_type != "yarn":
        return 1.0
    if sc.get("attention_factor"):
        return sc["attention_factor"]

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(sc["factor"], sc["mscale"]) / mscale(sc["factor"], sc["mscale_all_dim"])
    return mscale(sc["factor"])


class MoE(nn.Module):
    """A sparse mixture of SwiGLU experts (Qwen3-MoE): a router's softmax picks top_k experts per
    token (their weights renormalized to sum to 1 with norm_topk_prob), and each expert runs on its
    own tokens only, so a step costs the experts chosen, not all of them. Expert weights are stacked
    ([E, 2I, H] with gate over up, [E, H, I]) and run through torch's matmuls: the packed CPU
    kernels cache one packing per weight, which E slices of a stack would defeat."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, norm_topk: bool):
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(experts, hidden, inter), requires_grad=False)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        probs = torch.softmax(torch.nn.functional.linear(x, self.router.weight).float(), dim=-1)   # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)                                           # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        # the (token, slot) pairs grouped by expert: one matmul per expert over its own tokens
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.gate_up.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.top_k
            gate, up = torch.nn.functional.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down[e])
            out.index_add_(0, rows, y * weights[pairs, None])
        return out


class Rotary(nn.Module):
    """Rotary embedding on the first `rotary_dim` dims of each head (rotate-half layout).

    Qwen3.5's multimodal rope (mrope) gives every section the same position for text, so for text it
    is exactly this."""

    def __init__(self, rotary_dim: int, theta: float, max_pos: int, rope_type: str = "default",
                 scaling: dict | None = None):
        super().__init__()
        self.rotary_dim, self.theta, self.max_pos = rotary_dim, theta, max_pos
        self.rope_type, self.scaling = rope_type, dict(scaling or {})
        self._last = None
        self.materialize(torch.device("cpu"))

    def materialize(self, device: torch.device) -> None:
        """(Re)build the cos/sin tables on `device` (plain attributes: never part of a checkpoint)."""
        inv = inv_freq(self.rotary_dim, self.theta, self.rope_type, self.scaling, device)
        freqs = torch.arange(self.max_pos, dtype=torch.float, device=device)[:, None] * inv[None, :]  # [P, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)                                                           # [P, R]
        scale = attention_factor(self.rope_type, self.scaling)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale
        self._last = None

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions`, [T, 1, R]: gathered once per step (every layer, q and k, passes
        the same positions tensor), not twice per layer."""
        if self._last is None or self._last[0] is not positions or self._last[1] != dtype:
            self._last = (positions, dtype, self.cos[positions].to(dtype)[:, None, :],
                          self.sin[positions].to(dtype)[:, None, :])
        return self._last[2], self._last[3]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ops=None) -> torch.Tensor:
        """x [T, H, D] at `positions`; `ops`: the runner's kernels (their `rotary`), else the torch form."""
        cos, sin = self._tables(positions, x.dtype)            # [T, 1, R]
        return (ops or _ref).rotary(x, cos, sin)
