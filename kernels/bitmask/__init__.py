"""A grammar's token bitmask applied to the logits: the torch form (reference.py) and a CPU kernel
beside it (cpu_apply.cpp, cpu.py)."""
