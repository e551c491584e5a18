"""Triton FP8 casts equal the PyTorch contract (``redline.trainer.fp8.scaling``).

On CPU they run under ``TRITON_INTERPRET=1``. The interpreter's own fp32 -> fp8 conversion does not round
correctly (its round-to-nearest does not carry into the exponent and it mishandles subnormals), so CPU tests
use inputs whose scaled values are exactly representable normals: they check amax, scale, saturation,
transpose and stride handling bit for bit. Rounding of arbitrary values is checked on the GPU.
"""

import pytest
import torch

from redline.trainer.fp8.scaling import E4M3, E5M2, quantize_reference

cast = pytest.importorskip("redline.trainer.fp8.cast", reason="triton is not installed")


def representable(rows, cols, fmt, scale_exponent, seed=0):
    """fp32 values ``v * 2**scale_exponent`` with ``v`` normal FP8 numbers and each row's max |v| = fmt.max,
    so ``scale`` is a power of two and every ``x * scale`` is exact."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (rows, cols), generator=generator, dtype=torch.uint8)
    v = bits.view(fmt.dtype).float()
    smallest_normal = torch.finfo(fmt.dtype).smallest_normal
    v = torch.where(torch.isfinite(v) & (v.abs() >= smallest_normal), v, smallest_normal)
    v[:, 0] = fmt.max
    return (v * 2.0 ** scale_exponent).contiguous()


def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_tensorwise_cast_and_transpose_match_the_contract(fmt):
    x = representable(37, 70, fmt, scale_exponent=-5)  # not multiples of the tile: edge masks exercised
    got = cast.cast_transpose(x, cast.tensor_amax(x), fmt, transpose=True)
    want = quantize_reference(x, fmt, transpose=True)
    assert same_bytes(got.data, want.data) and same_bytes(got.data_t, want.data_t)
    assert torch.equal(got.scale_inv, want.scale_inv)


def test_amax_reduction_covers_every_block():
    x = torch.zeros(3 * cast.AMAX_BLOCK + 5)
    x[-1] = -7.5
    assert cast.tensor_amax(x).item() == 7.5


def test_cast_saturates_values_beyond_the_shared_amax():
    x = representable(16, 16, E4M3, scale_exponent=0)
    amax = torch.tensor(224.0)  # half the true amax: scale 2 pushes the largest values past 448
    got = cast.cast_transpose(x, amax, E4M3)
    assert got.data.float().abs().max().item() == 448.0
    assert same_bytes(got.data, (x * 2.0).clamp(-448, 448).to(E4M3.dtype))


@pytest.mark.parametrize("amax, scale_inv", [(0.0, 1.0), (float("inf"), 1.0)])
def test_degenerate_amax_uses_unit_scale(amax, scale_inv):
    got = cast.cast_transpose(torch.zeros(4, 4), torch.tensor(amax), E4M3)
    assert got.scale_inv.item() == scale_inv


def test_power_of_two_scale_matches_the_contract():
    x = representable(8, 16, E4M3, scale_exponent=0).clamp(-320.0, 320.0)  # amax 320: scale 1.4 floors to 1
    got = cast.cast_transpose(x, cast.tensor_amax(x), E4M3, pow2=True)
    assert got.scale_inv.item() == 1.0
    assert same_bytes(got.data, quantize_reference(x, E4M3, pow2=True).data)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_rowwise_cast_of_a_transposed_view_matches_the_contract(fmt):
    rows = representable(24, 40, fmt, scale_exponent=0) * 2.0 ** (torch.arange(24)[:, None] % 5 - 2)
    x = rows.t().contiguous().t()  # [24, 40] view with strides (1, 24): quantising columns of a row-major tensor
    got = cast.rowwise_cast(x, fmt)
    want = quantize_reference(x, fmt, rowwise=True)
    assert same_bytes(got.data, want.data)
    assert torch.equal(got.scale_inv, want.scale_inv)


@pytest.mark.gpu
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_cast_of_random_bf16_is_bit_identical_on_gpu(cuda, rowwise):
    generator = torch.Generator(device=cuda).manual_seed(0)
    x = (torch.randn(512, 768, device=cuda, generator=generator) * 3).bfloat16()
    x[7, 11] = 300.0  # an outlier
    for fmt in (E4M3, E5M2):
        if rowwise:
            got = cast.rowwise_cast(x.t(), fmt, pow2=True)
            want = quantize_reference(x.t(), fmt, rowwise=True, pow2=True)
        else:
            got = cast.cast_transpose(x, cast.tensor_amax(x), fmt, transpose=True)
            want = quantize_reference(x, fmt, transpose=True)
            assert same_bytes(got.data_t, want.data_t)
        assert same_bytes(got.data, want.data) and torch.equal(got.scale_inv, want.scale_inv)
