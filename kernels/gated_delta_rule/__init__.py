"""Gated delta rule (Gated DeltaNet) kernels: pure-torch references in `naive`."""

from .naive import (chunk_gated_delta_rule, gated_delta_rule_decode, gated_delta_rule_decode_depths, l2norm,
                    recurrent_gated_delta_rule)

__all__ = ["chunk_gated_delta_rule", "gated_delta_rule_decode", "gated_delta_rule_decode_depths", "l2norm",
           "recurrent_gated_delta_rule"]
