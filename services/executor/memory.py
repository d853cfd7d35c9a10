"""Device memory of one executor: the paged KV pool of the attention layers and the state-slot pool
of the DeltaNet layers. Plain tensors; who may use which page or slot is decided elsewhere.

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
        elem = torch.tensor([], dtype=plan.kv_dtype).element_size()
        self.bytes_per_token = 2 * n * spec.num_kv_heads * spec.head_dim * elem

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
        elem = torch.tensor([], dtype=plan.state_dtype).element_size()
        self.recurrent_bytes_per_slot = n * spec.lin_num_v_heads * spec.lin_k_dim * spec.lin_v_dim * elem
        self.conv_bytes_per_slot = n * spec.conv_dim * max(spec.conv_kernel - 1, 0) * elem

    def reset(self, slot: int) -> None:
        """A fresh sequence starts from the zero state."""
        for t in self.recurrent + self.conv:
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for t in self.recurrent + self.conv:
            t[dst].copy_(t[src])
