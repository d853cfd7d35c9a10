"""Linear layers: torch's matmul (reference.py) and, in bf16 on a CPU with AVX512-BF16 and no AMX,
a kernel over weights packed once (cpu.py, cpu_gemm.cpp)."""
