"""Causal depthwise short convolution kernels: pure-torch references in `naive`."""

from .naive import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update"]
