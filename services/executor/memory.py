"""Device memory of one executor: the paged KV pool of the attention layers and the state-slot pool
of the DeltaNet layers (plain tensors; who may use which page or slot is the radix service's call),
and the accounting of what they cost (`estimate` from a config alone, `realized` for a pool).

    KV pool, per attention layer:   k[l], v[l]        [num_pages * page_size, Hkv, D]
        token slot = page * page_size + offset; a sequence's page table lists its pages in order.
    State pool, per DeltaNet layer: recurrent[l]      [num_slots, Hv, Dk, Dv]  (fp32 by default)
                                    conv[l]           [num_slots, conv_dim, kernel - 1]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.spec import ModelSpec


@dataclass(frozen=True)
class MemoryPlan:
    page_size: int
    num_pages: int
    num_state_slots: int
    kv_dtype: torch.dtype
    state_dtype: torch.dtype

    @property
    def num_token_slots(self) -> int:
        return self.page_size * self.num_pages


class KVPool:
    def __init__(self, spec: ModelSpec, plan: MemoryPlan, device: torch.device):
        shape = (plan.num_token_slots, spec.num_kv_heads, spec.head_dim)
        n = len(spec.attn_layers)
        self.k = [torch.zeros(shape, dtype=plan.kv_dtype, device=device) for _ in range(n)]
        self.v = [torch.zeros(shape, dtype=plan.kv_dtype, device=device) for _ in range(n)]
        self.page_size = plan.page_size
        self.num_pages = plan.num_pages

    def token_slots(self, pages: list[int], length: int) -> torch.Tensor:
        """Slots of the first `length` tokens of a sequence whose page table is `pages`."""
        p = torch.tensor(pages, dtype=torch.int64)
        slots = (p[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
        return slots[:length]


class StatePool:
    def __init__(self, spec: ModelSpec, plan: MemoryPlan, device: torch.device):
        n = len(spec.linear_layers)
        rec = (plan.num_state_slots, spec.lin_num_v_heads, spec.lin_k_dim, spec.lin_v_dim)
        conv = (plan.num_state_slots, spec.conv_dim, max(spec.conv_kernel - 1, 0))
        self.recurrent = [torch.zeros(rec, dtype=plan.state_dtype, device=device) for _ in range(n)]
        self.conv = [torch.zeros(conv, dtype=plan.state_dtype, device=device) for _ in range(n)]
        self.num_slots = plan.num_state_slots
        self.device = device

    def reset(self, slot: int) -> None:
        """A fresh sequence starts from the zero state."""
        for t in self.recurrent + self.conv:
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for t in self.recurrent + self.conv:
            t[dst].copy_(t[src])

    # A step's copies (checkpoints of every sequence that finished its prompt, restores of every
    # admitted one) batched: one gather and one scatter per layer tensor instead of a small copy
    # per sequence and tensor, whose per-call overhead added up over a mixed step

    def reset_many(self, slots: list[int]) -> None:
        if slots:
            idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
            for t in self.recurrent + self.conv:
                t.index_fill_(0, idx, 0)

    def copy_many(self, pairs: list[tuple[int, int]]) -> None:
        """copy(src, dst) for every pair, as if one after the other."""
        srcs, dsts = {s for s, _ in pairs}, [d for _, d in pairs]
        if len(pairs) < 2 or len(set(dsts)) < len(dsts) or srcs & set(dsts):   # order would matter
            for s, d in pairs:
                self.copy(s, d)
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor(dsts, dtype=torch.int64, device=self.device)
        for t in self.recurrent + self.conv:
            t.index_copy_(0, dst, t.index_select(0, src))


# ---------------------------------------------------------------- accounting

_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
          "float8_e4m3fn": 1, "fp8": 1}


def dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.tensor([], dtype=dtype).element_size()
    name = str(dtype).replace("torch.", "")
    if name not in _BYTES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _BYTES[name]


def estimate(spec: ModelSpec, kv_dtype: str | torch.dtype, state_dtype: str | torch.dtype = "float32",
             conv_dtype: str | torch.dtype | None = None, prefix_tokens: int = 0, copies: int = 1) -> dict:
    """What a model's cache costs, from its config alone. KV: every full-attention layer stores K and V
    per token. State (hybrid): every DeltaNet layer keeps a [Hv, Dk, Dv] recurrent state (fp32 by
    default, as the reference implementation keeps it) and a short-conv state of kernel-1 inputs
    (in the model's dtype), per sequence, whatever its length."""
    kvb = dtype_bytes(kv_dtype)
    sb = dtype_bytes(state_dtype)
    cb = dtype_bytes(conv_dtype if conv_dtype is not None else kv_dtype)
    n_attn, n_lin = len(spec.attn_layers), len(spec.linear_layers)
    per_layer = 2 * spec.num_kv_heads * spec.head_dim * kvb
    per_token = n_attn * per_layer
    rec = n_lin * spec.lin_num_v_heads * spec.lin_k_dim * spec.lin_v_dim * sb
    conv = n_lin * spec.conv_dim * max(spec.conv_kernel - 1, 0) * cb
    return {
        "model_type": spec.model_type, "layers": spec.num_layers, "attention_layers": n_attn,
        "linear_attention_layers": n_lin, "kv_dtype": str(kv_dtype).replace("torch.", ""),
        "state_dtype": str(state_dtype).replace("torch.", ""),
        "conv_state_dtype": str(conv_dtype if conv_dtype is not None else kv_dtype).replace("torch.", ""),
        "kv_bytes_per_token_per_layer": per_layer, "kv_bytes_per_token": per_token,
        "recurrent_state_bytes_per_sequence": rec, "conv_state_bytes_per_sequence": conv,
        "state_bytes_per_sequence": rec + conv,
        "prefix_tokens": prefix_tokens, "prefix_kv_bytes": per_token * prefix_tokens,
        "copies": copies, "copies_kv_bytes": per_token * prefix_tokens * copies,
        "copies_state_bytes": (rec + conv) * copies,
    }


def realized(spec: ModelSpec, plan: MemoryPlan) -> dict:
    """What an executor actually allocated."""
    e = estimate(spec, plan.kv_dtype, plan.state_dtype, plan.state_dtype)
    return {k: e[k] for k in ("model_type", "attention_layers", "linear_attention_layers", "kv_dtype", "state_dtype",
                              "conv_state_dtype", "kv_bytes_per_token_per_layer", "kv_bytes_per_token",
                              "recurrent_state_bytes_per_sequence", "conv_state_bytes_per_sequence",
                              "state_bytes_per_sequence")} | {
        "page_size": plan.page_size, "kv_pages": plan.num_pages, "kv_token_slots": plan.num_token_slots,
        "kv_pool_bytes": plan.num_token_slots * e["kv_bytes_per_token"], "state_slots": plan.num_state_slots,
        "state_pool_bytes": plan.num_state_slots * e["state_bytes_per_sequence"]}


# ---------------------------------------------------------------- sizing from free memory


def free_bytes(device: torch.device) -> int:
    """Memory free on the device now: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def tokens_for(spec: ModelSpec, budget: int, kv_dtype: torch.dtype, state_slots: int,
               state_dtype: torch.dtype = torch.float32) -> int:
    """KV token slots that fit `budget` bytes once the state slots are paid for."""
    e = estimate(spec, kv_dtype, state_dtype, kv_dtype)
    rest = budget - state_slots * e["state_bytes_per_sequence"]
    return max(rest, 0) // max(e["kv_bytes_per_token"], 1)
