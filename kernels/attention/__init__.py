"""Attention over a paged KV pool: pure-torch references in `naive`, Triton kernels in `triton_*`
(imported on demand: kernels.dispatch)."""

from .cascade import SharedPrefix, attend_lse, cascade_decode, cascade_prefill, merge
from .naive import decode_attention, prefill_attention, write_kv

__all__ = ["SharedPrefix", "attend_lse", "cascade_decode", "cascade_prefill", "decode_attention", "merge",
           "prefill_attention", "write_kv"]
