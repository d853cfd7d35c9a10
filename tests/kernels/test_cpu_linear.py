"""The CPU linear-layer kernel (kernels/linear/cpu.py, cpu_gemm.cpp) against torch's matmul, in fp32 and
bf16, and how its packed weights are kept. `built`: conftest.py."""
from __future__ import annotations

import pytest
import torch

from radixflow.kernels import cpu_ext
from radixflow.kernels.elementwise import cpu as ew_cpu


LINEAR = [(1, 256, 64), (5, 256, 776), (6, 768, 256), (7, 64, 130), (97, 2, 3), (300, 256, 1536)]


@pytest.mark.parametrize("M,K,N", LINEAR)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_by_the_kernel_matches_the_reference(built, M, K, N, dtype, monkeypatch):
    """Linear layers by the kernel over packed weights (linear/cpu_gemm.cpp), x a strided view of a
    wider activation (as a layer's split hands it): against the product in fp64 within the dtype's
    rounding of the result, and against torch's matmul within one bf16 step (fp32: a few ulps);
    row counts around the 6-row micro-tile and the 96-row task, output widths past a 64-wide block's
    end. The gate/up form (SiLU-and-multiply in the product's pass) is bit-equal to linear, then
    silu_mul: bf16's rounds g and u where they would be rounded, fp32's runs silu_mul's expression on
    the accumulators. A row's result does not depend on the rows beside it (fp32: bit-equal alone and
    in the batch)."""
    from radixflow.kernels.linear import cpu as lin_cpu
    from radixflow.kernels.linear import reference as lin_ref
    ext = cpu_ext.get()
    if not (ext.linear_takes_bf16() if dtype == torch.bfloat16 else ext.linear_takes_fp32()):
        pytest.skip("this CPU has no AVX-512 (fp32), no AVX512-BF16 or has AMX (bf16)")
    gen = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K + 6, generator=gen).to(dtype)[:, 3:K + 3]
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    with monkeypatch.context() as m:
        m.setattr(lin_cpu.reference, "linear", lambda *a, **k: pytest.fail("went to the reference"))
        m.setattr(lin_cpu.reference, "linear_silu_mul", lambda *a, **k: pytest.fail("went to the reference"))
        got = lin_cpu.linear(x, w)
        fused = lin_cpu.linear_silu_mul(x, w) if N % 2 == 0 else None
    assert got.dtype == dtype and got.shape == (M, N)
    exact = (x.double() @ w.double().T).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, lin_ref.linear(x, w), atol=1e-5, rtol=1e-5)
        assert torch.equal(lin_cpu.linear(x[-1:], w), got[-1:])
        if fused is not None:
            assert torch.equal(fused, ew_cpu.silu_mul(got))
        return
    torch.testing.assert_close(got.float(), exact, atol=1e-3, rtol=2 ** -8)
    step = lin_ref.linear(x, w).float().abs().clamp_min(2 ** -100) * 2 ** -7
    assert ((got.float() - lin_ref.linear(x, w).float()).abs() <= step).all()
    if fused is not None:
        assert torch.equal(fused.view(torch.int16), ew_cpu.silu_mul(got).view(torch.int16))


def test_linear_packs_a_weight_once_and_again_when_it_changes(built):
    """The packed copy is kept on the weight: a second call reuses it, a weight written in place (a
    reload) is packed again; 3-D inputs keep their leading dims; fp64 goes to torch's matmul."""
    from radixflow.kernels.linear import cpu as lin_cpu
    if not cpu_ext.get().linear_takes_bf16():
        pytest.skip("this CPU has no AVX512-BF16, or has AMX (oneDNN's tile kernels serve)")
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Linear(128, 96, bias=False).weight.detach().bfloat16()
    x = torch.randn(2, 5, 128, generator=gen).bfloat16()
    first = lin_cpu.linear(x, w)
    packed = w._rf_packed[1]
    assert first.shape == (2, 5, 96)
    lin_cpu.linear(x, w)
    assert w._rf_packed[1] is packed
    w.mul_(2)
    again = lin_cpu.linear(x, w)
    assert w._rf_packed[1] is not packed and torch.equal(again, lin_cpu.reference.linear(x, w))
    xf, wf = x.double(), w.double()
    assert torch.equal(lin_cpu.linear(xf, wf), torch.nn.functional.linear(xf, wf)) and not hasattr(wf, "_rf_packed")
    # bf16 over a K past BF16_LONG_K: many rows go to oneDNN (the kernel does not block K), a few to the kernel
    K = lin_cpu.BF16_LONG_K + 2
    wl = torch.randn(64, K, generator=gen).bfloat16()
    lin_cpu.linear(torch.randn(lin_cpu.BF16_LONG_K_ROWS + 1, K, generator=gen).bfloat16(), wl)
    assert not hasattr(wl, "_rf_packed")
    lin_cpu.linear(torch.randn(40, K, generator=gen).bfloat16(), wl)
    assert hasattr(wl, "_rf_packed")
