"""Fused RMSNorm and SwiGLU (``rms_norm_triton``, ``swiglu_triton``) against the eager definitions in
``torch_layers``.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by the root conftest); shapes are ragged (rows not a
multiple of the row block, widths not powers of two). Gradients are compared with autograd through the eager
definition in float64. CPU tensors outside the kernel tests take the eager code itself (HF parity relies on it).
"""

import pytest
import torch

from redline.trainer.layers.torch_layers import (NormLinear, RMSNorm, fused_rms_norm, fused_swiglu, rms_norm,
                                                 swiglu)

norm_kernels = pytest.importorskip("redline.trainer.layers.rms_norm_triton", reason="triton is not installed")
swiglu_kernels = pytest.importorskip("redline.trainer.layers.swiglu_triton", reason="triton is not installed")
rms_norm_triton, swiglu_triton = norm_kernels.rms_norm_triton, swiglu_kernels.swiglu_triton

EPS = 1e-6
SHAPES = [(37, 96), (5, 3, 200), (200,)]
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values: one ulp is at most this fraction of the value


def randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def norm_inputs(shape, dtype, device="cpu"):
    return randn(*shape, dtype=dtype, device=device), (1 + 0.5 * randn(shape[-1], seed=1, device=device)).to(dtype)


def grads(fn, *inputs, d_out):
    """Gradients of ``(fn(*inputs) * d_out).sum()`` with respect to ``inputs``."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    fn(*leaves).backward(d_out)
    return [t.grad for t in leaves]


def assert_close_in_bf16_ulps(got, want, ulps, min_identical):
    """Every element within ``ulps`` bf16 ulps of ``want``, and at least ``min_identical`` of them equal."""
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * BF16_ULP, atol=0)
    assert (got == want).float().mean() >= min_identical


# --- RMSNorm --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_norm_matches_the_eager_cast_order(shape):
    x, weight = norm_inputs(shape, torch.bfloat16)
    # a last-bit difference of the fp32 rstd (sum order) moves normed by one ulp, the output by up to two
    assert_close_in_bf16_ulps(rms_norm_triton(x, weight, EPS), rms_norm(x, weight, EPS), 2, min_identical=0.999)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_norm_and_gradients_match_float64(shape):
    x, weight = norm_inputs(shape, torch.float32)
    d_out = randn(*shape, seed=2)
    torch.testing.assert_close(rms_norm_triton(x, weight, EPS).double(), rms_norm(x.double(), weight.double(), EPS),
                               rtol=1e-6, atol=1e-6)
    got = grads(lambda a, w: rms_norm_triton(a, w, EPS), x, weight, d_out=d_out)
    want = grads(lambda a, w: rms_norm(a, w, EPS), x.double(), weight.double(), d_out=d_out.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_bf16_norm_gradients_track_float64():
    x, weight = norm_inputs((37, 96), torch.bfloat16)
    d_out = randn(37, 96, dtype=torch.bfloat16, seed=2)
    got = grads(lambda a, w: rms_norm_triton(a, w, EPS), x, weight, d_out=d_out)
    want = grads(lambda a, w: rms_norm(a, w, EPS), x.double(), weight.double(), d_out=d_out.double())
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w, rtol=2 * BF16_ULP, atol=2e-2)


def test_fp32_weight_on_bf16_input_promotes_like_eager():
    x, weight = norm_inputs((37, 96), torch.bfloat16)
    got, want = rms_norm_triton(x, weight.float(), EPS), rms_norm(x, weight.float(), EPS)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=BF16_ULP, atol=0)


def test_per_head_view_of_a_fused_projection_is_read_in_place():
    tokens, heads, head_dim = 11, 3, 96
    qkv = randn(tokens, 3 * heads * head_dim, dtype=torch.bfloat16)
    q = qkv.split(heads * head_dim, dim=-1)[1].unflatten(-1, (heads, head_dim))  # rows not evenly spaced
    weight = (1 + 0.5 * randn(head_dim, seed=1)).bfloat16()
    d_out = randn(tokens, heads, head_dim, dtype=torch.bfloat16, seed=2)
    assert torch.equal(rms_norm_triton(q, weight, EPS), rms_norm_triton(q.contiguous(), weight, EPS))
    strided = grads(lambda a, w: rms_norm_triton(a, w, EPS), q, weight, d_out=d_out)
    packed = grads(lambda a, w: rms_norm_triton(a, w, EPS), q.contiguous(), weight, d_out=d_out)
    assert all(torch.equal(s, p) for s, p in zip(strided, packed))


def test_weight_of_the_wrong_width_is_rejected():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(torch.randn(4, 96), torch.ones(95), EPS)


# --- SwiGLU ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(13, 2 * 200), (2, 5, 2 * 96)])
def test_fp32_swiglu_and_gradients_match_float64(shape):
    gate_up, d_out = randn(*shape), randn(*shape[:-1], shape[-1] // 2, seed=2)
    torch.testing.assert_close(swiglu_triton(gate_up).double(), swiglu(gate_up.double()), rtol=1e-6, atol=1e-6)
    (got,) = grads(swiglu_triton, gate_up, d_out=d_out)
    (want,) = grads(swiglu, gate_up.double(), d_out=d_out.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_bf16_swiglu_is_within_one_ulp_of_eager():
    gate_up = randn(13, 2 * 200, dtype=torch.bfloat16)
    # eager rounds silu(gate) before the product, the kernel rounds once: they differ in the last bit often
    assert_close_in_bf16_ulps(swiglu_triton(gate_up), swiglu(gate_up), 1, min_identical=0.5)


def test_swiglu_reads_a_row_strided_input():
    wide = randn(13, 2 * 200 + 8)
    gate_up, d_out = wide[:, :400], randn(13, 200, seed=2)
    assert torch.equal(swiglu_triton(gate_up), swiglu_triton(gate_up.contiguous()))
    assert torch.equal(grads(swiglu_triton, gate_up, d_out=d_out)[0],
                       grads(swiglu_triton, gate_up.contiguous(), d_out=d_out)[0])


def test_odd_gate_up_width_is_rejected():
    with pytest.raises(ValueError, match="equal width"):
        swiglu_triton(torch.randn(4, 7))


# --- dispatch -------------------------------------------------------------------------------------------------

def test_norm_of_cpu_tensors_is_the_eager_code_bit_for_bit():
    x, weight = norm_inputs((37, 96), torch.float32)
    d_out = randn(37, 96, seed=2)
    assert torch.equal(fused_rms_norm(x, weight, EPS), rms_norm(x, weight, EPS))
    fused = grads(lambda a, w: fused_rms_norm(a, w, EPS), x, weight, d_out=d_out)
    eager = grads(lambda a, w: rms_norm(a, w, EPS), x, weight, d_out=d_out)
    assert all(torch.equal(f, e) for f, e in zip(fused, eager))


def test_swiglu_of_cpu_tensors_is_the_eager_code_bit_for_bit():
    gate_up, d_out = randn(13, 2 * 200), randn(13, 200, seed=2)
    assert torch.equal(fused_swiglu(gate_up), swiglu(gate_up))
    assert torch.equal(grads(fused_swiglu, gate_up, d_out=d_out)[0], grads(swiglu, gate_up, d_out=d_out)[0])


def test_norm_modules_run_the_eager_norm_on_cpu():
    x = randn(7, 96)
    norm, norm_linear = RMSNorm(96, EPS), NormLinear(96, (32, 32), bias=False, eps=EPS)
    for module, weight in ((norm, norm.weight), (norm_linear, norm_linear.norm_weight)):
        with torch.no_grad():
            weight.copy_(1 + 0.5 * randn(96, seed=1))
        normalize = module if module is norm else module.normalize
        assert torch.equal(normalize(x), rms_norm(x, weight, EPS))


# --- GPU: realistic shapes, compiled kernels ------------------------------------------------------------------

@pytest.mark.gpu
def test_llama_hidden_norm_on_gpu(cuda):
    x, weight = norm_inputs((16384, 4096), torch.bfloat16, device=cuda)
    d_out = randn(16384, 4096, dtype=torch.bfloat16, seed=2, device=cuda)
    out = fused_rms_norm(x, weight, EPS)
    assert_close_in_bf16_ulps(out, rms_norm(x, weight, EPS), 2, min_identical=0.999)
    got = grads(lambda a, w: fused_rms_norm(a, w, EPS), x, weight, d_out=d_out)
    want = grads(lambda a, w: rms_norm(a, w, EPS), x.float(), weight.float(), d_out=d_out.float())
    torch.testing.assert_close(got[0].float(), want[0], rtol=2 * BF16_ULP, atol=1e-2)
    torch.testing.assert_close(got[1].float(), want[1], rtol=2 * BF16_ULP, atol=1.0)  # a sum of 16384 terms
    again = grads(lambda a, w: fused_rms_norm(a, w, EPS), x, weight, d_out=d_out)
    assert all(torch.equal(g, a) for g, a in zip(got, again))  # dweight's reduction is deterministic


@pytest.mark.gpu
def test_per_head_norm_on_gpu(cuda):
    qkv = randn(16384, (32 + 8 + 8) * 128, dtype=torch.bfloat16, device=cuda)
    q = qkv.split((32 * 128, 8 * 128, 8 * 128), dim=-1)[0].unflatten(-1, (32, 128))
    weight = (1 + 0.5 * randn(128, seed=1, device=cuda)).bfloat16()
    assert_close_in_bf16_ulps(fused_rms_norm(q, weight, EPS), rms_norm(q, weight, EPS), 2, min_identical=0.999)
    d_out = randn(16384, 32, 128, dtype=torch.bfloat16, seed=2, device=cuda)
    got = grads(lambda a, w: fused_rms_norm(a, w, EPS), q, weight, d_out=d_out)
    want = grads(lambda a, w: rms_norm(a, w, EPS), q.float(), weight.float(), d_out=d_out.float())
    torch.testing.assert_close(got[0].float(), want[0], rtol=2 * BF16_ULP, atol=1e-2)
    torch.testing.assert_close(got[1].float(), want[1], rtol=2 * BF16_ULP, atol=4.0)  # a sum of 2**19 terms


@pytest.mark.gpu
def test_llama_swiglu_on_gpu(cuda):
    gate_up = randn(4096, 2 * 14336, dtype=torch.bfloat16, device=cuda)
    assert_close_in_bf16_ulps(fused_swiglu(gate_up), swiglu(gate_up), 1, min_identical=0.5)
    d_out = randn(4096, 14336, dtype=torch.bfloat16, seed=2, device=cuda)
    (got,) = grads(fused_swiglu, gate_up, d_out=d_out)
    (want,) = grads(swiglu, gate_up.float(), d_out=d_out.float())
    torch.testing.assert_close(got.float(), want, rtol=BF16_ULP, atol=1e-5)
