"""The compute floor of a workload: the FLOPs of the tokens actually computed, from the model
config, over a GEMM peak measured on this machine at the model's shapes.

    floor_s = FLOPs / peak;   a run's wall / floor_s says how far it is from the compute the
    machine cannot avoid (1.0: every second spent in matmuls at peak)

FLOPs count 2 per multiply-add, for what dominates at these sizes:
- projections: per token, every layer's weights (attention q/k/v/o or DeltaNet in/out, the MLP);
- attention: a token at position p reads p + 1 keys (QK^T and PV: 4 * heads * head_dim each);
- DeltaNet: per token, the recurrence reads and writes each head's dk x dv state about 3 times;
- the LM head: only for the rows whose logits are computed (a prompt's last token, every output).
Norms, rotary, activations and sampling are left out (a few percent at most).
"""
from __future__ import annotations

import time

from radixflow.services.executor.models.spec import ModelSpec


def _per_token(spec: ModelSpec) -> tuple[float, float]:
    """(FLOPs per token of every layer's projections and recurrences, FLOPs per key read by one
    token across the attention layers)."""
    H, I = spec.hidden_size, spec.intermediate_size
    proj, per_key = 0.0, 0.0
    for kind in spec.layer_types:
        proj += 2 * 3 * H * I                                                         # MLP: gate, up, down
        if kind == "full_attention":
            q_out = spec.num_heads * spec.head_dim * (2 if spec.attn_output_gate else 1)
            proj += 2 * H * (q_out + 2 * spec.num_kv_heads * spec.head_dim)         # q (and gate), k, v
            proj += 2 * spec.num_heads * spec.head_dim * H                          # o
            per_key += 4 * spec.num_heads * spec.head_dim                           # QK^T and PV
        else:
            value_dim = spec.lin_num_v_heads * spec.lin_v_dim
            proj += 2 * H * (spec.conv_dim + value_dim + 2 * spec.lin_num_v_heads)  # in_proj (qkv, z, b, a)
            proj += 2 * value_dim * H                                               # out_proj
            proj += 2 * 3 * spec.lin_num_v_heads * spec.lin_k_dim * spec.lin_v_dim  # the recurrence
    return proj, per_key


def span_flops(spec: ModelSpec, start: int, end: int, logits: int = 1) -> float:
    """FLOPs of computing positions [start, end) of one sequence (start: tokens already cached),
    with `logits` LM-head rows."""
    proj, per_key = _per_token(spec)
    n = end - start
    keys = (end * (end + 1) - start * (start + 1)) / 2          # sum over p in [start, end) of p + 1
    return n * proj + keys * per_key + logits * 2 * spec.hidden_size * spec.vocab_size


def request_flops(spec: ModelSpec, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
    """One request: its uncached prompt tail (one logits row), then each output token but the last
    computed one at a time (the last sampled token is never fed back)."""
    total = span_flops(spec, cached_tokens, prompt_tokens) if prompt_tokens > cached_tokens else 0.0
    for p in range(prompt_tokens, prompt_tokens + max(output_tokens - 1, 0)):
        total += span_flops(spec, p, p + 1)
    return total


def gemm_peak(spec: ModelSpec, rows: int = 1024, repeats: int = 40, dtype: str = "float32") -> float:
    """Best FLOP/s of matmuls in the serving dtype at the model's projection shapes, [rows, in] x
    [in, out], measured here: torch's and, where they take the dtype, the CPU linear kernels' the
    engine runs (kernels/linear; MKL's fp32 can trail the kernel, and a floor from the slower one
    would flatter the wall over it). Run it in a
    process of its own when the caller also serves (bench/common.EngineHost says why)."""
    import torch
    dtype = getattr(torch, dtype)
    shapes = {(spec.hidden_size, spec.intermediate_size), (spec.intermediate_size, spec.hidden_size),
              (spec.hidden_size, spec.num_heads * spec.head_dim)}
    kernel = _cpu_linear()
    best = 0.0
    for k, n in shapes:
        a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        w = b.t().contiguous()
        runs = [lambda: torch.matmul(a, b)]
        if kernel is not None and kernel._ext(a, w) is not None:
            runs.append(lambda: kernel.linear(a, w))
        for run in runs:
            for _ in range(3):                               # first calls: allocation, kernel choice, clocks
                run()
            for _ in range(repeats):
                t0 = time.perf_counter()
                run()
                best = max(best, 2 * rows * k * n / (time.perf_counter() - t0))
    return best


def _cpu_linear():
    """kernels.linear.cpu once the CPU kernels are built (None where they cannot be)."""
    from radixflow.kernels import cpu_ext
    if cpu_ext.wait(600) is None:
        return None
    from radixflow.kernels.linear import cpu
    return cpu


def measure_peak(model: str, dtype: str = "float32") -> float:
    """gemm_peak in a spawned process (this one's main thread runs no torch)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_peak_of, model, dtype).result()


def _peak_of(model: str, dtype: str) -> float:
    return gemm_peak(ModelSpec.from_dir(model), dtype=dtype)
