"""Causal depthwise short convolution kernels: pure-torch references in `naive`."""

from .naive import causal_conv1d, causal_conv1d_padded, causal_conv1d_update, causal_conv1d_update_depths

__all__ = ["causal_conv1d", "causal_conv1d_padded", "causal_conv1d_update", "causal_conv1d_update_depths"]
