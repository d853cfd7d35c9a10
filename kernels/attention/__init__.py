"""Attention over a paged KV pool: pure-torch references in `naive`."""

from .naive import decode_attention, prefill_attention, write_kv

__all__ = ["decode_attention", "prefill_attention", "write_kv"]
