"""The FP8 current-scaling contract (TE Float8CurrentScaling formulas) in plain PyTorch."""

import pytest
import torch

from redline.trainer.fp8.scaling import E4M3, E5M2, FLT_MAX, quantize_reference, scale_from_amax


@pytest.mark.parametrize("amax", [0.0, float("inf"), float("nan")])
def test_degenerate_amax_gives_unit_scale(amax):
    assert scale_from_amax(torch.tensor(amax), E4M3.max).item() == 1.0


def test_scale_is_the_correctly_rounded_fp32_quotient():
    amax = torch.tensor([3.0, 0.1, 1e-3, 7.77], dtype=torch.float32)
    expected = (448.0 / amax.double()).float()  # fp64 division then rounding = correctly rounded fp32
    assert torch.equal(scale_from_amax(amax, E4M3.max), expected)


def test_overflowing_scale_becomes_flt_max():
    assert scale_from_amax(torch.tensor(1e-44), E5M2.max).item() == FLT_MAX


def test_power_of_two_scale_is_floored():
    scale = scale_from_amax(torch.tensor([3.0, 448.0, 100.0]), E4M3.max, pow2=True)
    assert scale.tolist() == [128.0, 1.0, 4.0]  # 149.33 -> 128, 1 -> 1, 4.48 -> 4


def test_values_beyond_the_range_saturate():
    x = torch.tensor([[1.0, -2.0, 4.0]])
    scale = torch.tensor(200.0)  # 4 * 200 = 800 > 448
    from redline.trainer.fp8.scaling import cast_with_scale

    assert cast_with_scale(x, scale, E4M3).float().tolist() == [[192.0, -384.0, 448.0]]


def test_tensorwise_quantisation_maps_amax_to_the_format_max():
    x = torch.tensor([[0.5, -3.0], [1.5, 2.0]])
    q = quantize_reference(x, E4M3, transpose=True)
    assert q.data.float().abs().max().item() == 448.0
    assert q.scale_inv.item() == pytest.approx(3.0 / 448.0, rel=1e-7)
    assert torch.equal(q.data_t.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))


def test_rowwise_quantisation_has_one_scale_per_row():
    x = torch.tensor([[1.0, -2.0], [10.0, 5.0]])
    q = quantize_reference(x, E4M3, rowwise=True)
    assert q.scale_inv.shape == (2, 1)
    torch.testing.assert_close(q.scale_inv.squeeze(1), torch.tensor([2.0, 10.0]) / 448.0)
