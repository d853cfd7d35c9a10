"""Elementwise ops of the model layers (RMSNorm, SwiGLU's SiLU-and-multiply, the gated norm of a
DeltaNet head): torch references, and fused CPU kernels beside them."""
