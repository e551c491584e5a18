"""``scale_triton.scale_`` (Triton's interpreter on CPU): the in-place scale the policy loss's backward applies."""

import pytest
import torch

from redline.kernels import scale_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("value", [1.0, 2.5, -0.3], ids=["one", "up", "negative"])
def test_scale_is_fp32_arithmetic_rounded_once(dtype, value):
    x = torch.randn(2 * scale_triton.BLOCK + 77, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = (x.float() * value).to(dtype)  # fp32 arithmetic with the scale unrounded, one rounding at the end
    assert scale_triton.scale_(x, torch.tensor(value)) is x
    # bf16: Triton's interpreter rounds fp32 -> bf16 differently in the last bit (the GPU test below: bitwise)
    ulp = dict(rtol=2**-7, atol=0) if dtype == torch.bfloat16 and value != 1.0 else dict(rtol=0, atol=0)
    torch.testing.assert_close(x, expected, **ulp)


def test_scale_refuses_a_strided_tensor_or_a_scale_of_several_elements():
    with pytest.raises(ValueError, match="contiguous x"):
        scale_triton.scale_(torch.ones(8, 8).t(), torch.tensor(2.0))
    with pytest.raises(ValueError, match="2 elements"):
        scale_triton.scale_(torch.ones(8), torch.ones(2))


@pytest.mark.gpu
def test_gpu_scale_is_fp32_arithmetic_rounded_once(cuda):
    """Bitwise (x·s in fp32, rounded to nearest even); ``Tensor.mul_`` would first round an fp32 ``s`` to bf16."""
    x = torch.randn(10**6 + 3, device=cuda).to(torch.bfloat16)
    for value in (1.0, 0.37):
        expected = (x.float() * value).to(torch.bfloat16)
        torch.testing.assert_close(scale_triton.scale_(x, torch.tensor(value, device=cuda)), expected, rtol=0, atol=0)
