"""Which implementation of each op the executor runs: the pure-torch references (always there) or
the Triton kernels beside them, chosen once per model runner.

    auto    the Triton kernels on a CUDA device, the CPU kernels on a CPU (a CPU has no Triton backend)
    torch   the references everywhere
    cpu     the references, but decode attention (one query per sequence, read in place in the
            pool), the DeltaNet ops (the recurrent rule and the short conv, in prefill,
            decode and a jump-forward step's depths) by C++ kernels compiled on the machine
            (cpu_ext.py), in place in the state pool; the layers' elementwise ops (RMSNorm,
            SiLU-and-multiply, the gated norm) fused, and a grammar's bitmask applied to the
            logits; the references serve until the build is done, or if it fails
    triton  the kernels everywhere; on a CPU only under TRITON_INTERPRET=1 (Triton's interpreter,
            which is how the parity tests and CI run them without a GPU)

RADIXFLOW_KERNELS, when set, overrides the configured choice. A kernel and its reference share one
signature (the reference's docstring holds the contract), so callers never branch on the choice.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from .bitmask import reference as _bitmask
from .elementwise import reference as _ew
from .interpreter import interpreting
from .linear import reference as _linear

__all__ = ["Kernels", "CHOICES", "cpu_kernels", "interpreting", "pick", "reference", "triton_kernels"]

CHOICES = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class Kernels:
    name: str                                  # "torch" | "cpu" | "triton"
    write_kv: Callable                         # attention.naive.write_kv
    decode_attention: Callable                 # attention.naive.decode_attention
    extend_attention: Callable                 # attention.naive.extend_attention
    cascade_decode: Callable                   # attention.cascade.cascade_decode
    cascade_prefill: Callable                  # attention.cascade.cascade_prefill
    gated_delta_rule_decode_slots: Callable    # gated_delta_rule.naive.gated_delta_rule_decode_slots
    gated_delta_rule_prefill_slots: Callable   # gated_delta_rule.packed.gated_delta_rule_prefill_slots
    gated_delta_rule_decode_depths_slots: Callable   # gated_delta_rule.naive (jump-forward draft rows)
    causal_conv1d_update_slots: Callable       # causal_conv1d.naive.causal_conv1d_update_slots
    causal_conv1d_prefill_slots: Callable      # causal_conv1d.packed.causal_conv1d_prefill_slots
    causal_conv1d_update_depths_slots: Callable  # causal_conv1d.naive (jump-forward draft rows)
    # the layers' elementwise ops and a grammar's bitmask on CPU logits: torch's everywhere but in
    # the cpu kernels (a Triton runner's logits are on the device: constrain.apply_bitmask_device)
    rms_norm: Callable = _ew.rms_norm
    add_rms_norm: Callable = _ew.add_rms_norm
    silu_mul: Callable = _ew.silu_mul
    gated_rms_norm: Callable = _ew.gated_rms_norm
    apply_bitmask: Callable = _bitmask.apply_bitmask
    rotary: Callable = _ew.rotary
    # the linear layers: torch's matmul everywhere but in the cpu kernels (kernels/linear/cpu.py:
    # fp32 where the CPU has AVX-512, bf16 where it has AVX512-BF16 and no AMX)
    linear: Callable = _linear.linear
    linear_silu_mul: Callable = _linear.linear_silu_mul


def reference() -> Kernels:
    from .attention.cascade import cascade_decode, cascade_prefill
    from .attention.naive import decode_attention, extend_attention, write_kv
    from .causal_conv1d.naive import causal_conv1d_update_depths_slots, causal_conv1d_update_slots
    from .causal_conv1d.packed import causal_conv1d_prefill_slots
    from .gated_delta_rule.naive import gated_delta_rule_decode_depths_slots, gated_delta_rule_decode_slots
    from .gated_delta_rule.packed import gated_delta_rule_prefill_slots
    return Kernels("torch", write_kv, decode_attention, extend_attention, cascade_decode, cascade_prefill,
                   gated_delta_rule_decode_slots, gated_delta_rule_prefill_slots, gated_delta_rule_decode_depths_slots,
                   causal_conv1d_update_slots, causal_conv1d_prefill_slots, causal_conv1d_update_depths_slots)


def cpu_kernels() -> Kernels:
    import dataclasses

    from .attention import cpu as attention
    from .bitmask import cpu as bitmask
    from .causal_conv1d import cpu as conv
    from .elementwise import cpu as ew
    from .gated_delta_rule import cpu as gdr
    from .linear import cpu as linear
    return dataclasses.replace(reference(), name="cpu", rms_norm=ew.rms_norm, add_rms_norm=ew.add_rms_norm,
                               silu_mul=ew.silu_mul, linear=linear.linear, linear_silu_mul=linear.linear_silu_mul,
                               gated_rms_norm=ew.gated_rms_norm, apply_bitmask=bitmask.apply_bitmask, rotary=ew.rotary,
                               decode_attention=attention.decode_attention, cascade_decode=attention.cascade_decode,
                               cascade_prefill=attention.cascade_prefill, extend_attention=attention.extend_attention,
                               gated_delta_rule_decode_slots=gdr.gated_delta_rule_decode_slots,
                               gated_delta_rule_decode_depths_slots=gdr.gated_delta_rule_decode_depths_slots,
                               gated_delta_rule_prefill_slots=gdr.gated_delta_rule_prefill_slots,
                               causal_conv1d_update_slots=conv.causal_conv1d_update_slots,
                               causal_conv1d_update_depths_slots=conv.causal_conv1d_update_depths_slots,
                               causal_conv1d_prefill_slots=conv.causal_conv1d_prefill_slots)


def triton_kernels() -> Kernels:
    from .attention.triton_decode import decode_attention
    from .attention.triton_extend import cascade_decode, cascade_prefill, extend_attention
    from .attention.triton_write import write_kv
    from .causal_conv1d.triton_prefill import causal_conv1d_prefill_slots
    from .causal_conv1d.triton_update import causal_conv1d_update_depths_slots, causal_conv1d_update_slots
    from .gated_delta_rule.triton_decode import gated_delta_rule_decode_depths_slots, gated_delta_rule_decode_slots
    from .gated_delta_rule.triton_prefill import gated_delta_rule_prefill_slots
    return Kernels("triton", write_kv, decode_attention, extend_attention, cascade_decode, cascade_prefill,
                   gated_delta_rule_decode_slots, gated_delta_rule_prefill_slots, gated_delta_rule_decode_depths_slots,
                   causal_conv1d_update_slots, causal_conv1d_prefill_slots, causal_conv1d_update_depths_slots)


def pick(device: torch.device, choice: str = "auto") -> Kernels:
    """The kernels for `device` (see the module docstring); a clear error for an impossible choice."""
    choice = os.environ.get("RADIXFLOW_KERNELS") or choice
    if choice not in CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "cpu" if device.type == "cpu" else "torch"
    if choice == "torch":
        return reference()
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the CPU kernels run on a CPU (this runner is on {device.type})")
        return cpu_kernels()
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need a CUDA device (this runner is on {device.type}); "
                         "on a CPU they run only under TRITON_INTERPRET=1, for testing")
    return triton_kernels()
