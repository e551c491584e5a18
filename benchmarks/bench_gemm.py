"""GEMM peaks on this GPU: bf16 cuBLAS (baseline) against FP8 ``torch._scaled_mm`` (tensorwise and rowwise).

The peaks measured here are what the layer benchmarks divide by ("TFLOP/s vs the bf16 and FP8 peaks measured in
the same run").
"""

import pytest
import torch

pytestmark = pytest.mark.gpu
SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336)]  # (M, K, N): a square peak and a Llama-3-8B MLP up-proj


def _operands(m, k, n):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return a, b


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_bf16_mm(gpu_bench, m, k, n):
    a, b = _operands(m, k, n)
    gpu_bench(lambda: torch.mm(a, b.t()), group=f"gemm M={m} K={k} N={n}", provider="torch.mm bf16 (cuBLAS)",
              baseline=True, flops=2 * m * k * n, rounds=20, M=m, K=k, N=n)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_scaled_mm(gpu_bench, m, k, n, scaling):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    a, b = _operands(m, k, n)
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    if scaling == "tensorwise":
        sa = (a.abs().amax().float() / fmax).reshape(())
        sb = (b.abs().amax().float() / fmax).reshape(())
    else:
        sa = a.abs().amax(dim=1, keepdim=True).float() / fmax
        sb = (b.abs().amax(dim=1, keepdim=True).float() / fmax).t()
    a8 = (a / (sa if scaling == "rowwise" else sa)).to(fp8)
    b8 = (b / (sb.t() if scaling == "rowwise" else sb)).to(fp8)
    expected = torch.mm(a.float(), b.float().t())
    out = gpu_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                    group=f"gemm M={m} K={k} N={n}", provider=f"torch._scaled_mm fp8 e4m3 {scaling}",
                    flops=2 * m * k * n, rounds=20, M=m, K=k, N=n)
    rel = ((out.float() - expected).norm() / expected.norm()).item()
    assert rel < 0.08, f"FP8 GEMM relative error {rel:.3f} is too large for e4m3"
