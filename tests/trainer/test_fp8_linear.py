"""Native FP8 linear layers: each GEMM equals the product of the dequantised FP8 operands."""

import pytest
import torch
import torch.nn.functional as F

from redline.trainer.fp8.linear import FP8Matmul, NativeFP8Backend
from redline.trainer.fp8.scaling import E4M3, E5M2, quantize_reference
from redline.trainer.models import from_config


def dequantized(x, fmt, rowwise=False, pow2=False):
    q = quantize_reference(x, fmt, rowwise=rowwise, pow2=pow2)
    return q.data.float() * q.scale_inv


@pytest.fixture
def operands():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 48, generator=generator, requires_grad=True)
    weight = (torch.randn(16, 48, generator=generator) * 0.1).requires_grad_()
    grad = torch.randn(32, 16, generator=generator)
    return x, weight, grad


def test_tensorwise_gemms_use_e4m3_operands_and_e5m2_gradients(operands):
    x, weight, grad = operands
    y = FP8Matmul("tensorwise")(x, weight)
    y.backward(grad)
    xd, wd, gd = dequantized(x.detach(), E4M3), dequantized(weight.detach(), E4M3), dequantized(grad, E5M2)
    torch.testing.assert_close(y, xd @ wd.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, gd @ wd, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, gd.t() @ xd, rtol=1e-5, atol=1e-5)


def test_rowwise_gemms_scale_along_each_contraction_dim(operands):
    x, weight, grad = operands
    y = FP8Matmul("rowwise", grad_format=E4M3)(x, weight)
    y.backward(grad)
    dx, dw = x.grad, weight.grad
    x, weight = x.detach(), weight.detach()

    def rows(t, fmt=E4M3):  # per-row scales over the last (contraction) dim, power-of-two
        return dequantized(t, fmt, rowwise=True, pow2=True)

    torch.testing.assert_close(y, rows(x) @ rows(weight).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, rows(grad) @ rows(weight.t()).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rows(grad.t()) @ rows(x.t()).t(), rtol=1e-5, atol=1e-5)


def test_leading_dims_are_flattened_and_restored(operands):
    x, weight, _ = operands
    y = FP8Matmul()(x.detach().reshape(4, 8, 48), weight.detach())
    torch.testing.assert_close(y.reshape(32, 16), FP8Matmul()(x.detach(), weight.detach()))


def test_unknown_scaling_is_rejected():
    with pytest.raises(ValueError, match="scaling='blockwise'"):
        FP8Matmul("blockwise")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_model_log_probs_stay_close_to_full_precision(config_of, batch_of, scaling):
    """Per-token log-prob difference FP8 vs fp32 on a tiny random Qwen3, reported and bounded."""
    config = config_of("qwen3")
    reference = from_config(config, dtype=torch.float32, seed=0)
    fp8 = from_config(config, backend=NativeFP8Backend(scaling), dtype=torch.float32, seed=0)
    input_ids, cu_seqlens = batch_of((16, 16), config.vocab_size)
    targets = input_ids.roll(-1)
    with torch.no_grad():
        logp_ref = F.log_softmax(reference.logits(input_ids, cu_seqlens), -1).gather(1, targets[:, None])
        logp_fp8 = F.log_softmax(fp8.logits(input_ids, cu_seqlens), -1).gather(1, targets[:, None])
    delta = (logp_fp8 - logp_ref).abs()
    print(f"native FP8 ({scaling}) vs fp32: mean |dlogp| {delta.mean():.4f}, max {delta.max():.4f}")
    assert delta.mean() < 0.02 and delta.max() < 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_linear_on_gpu_tracks_bf16(cuda, scaling):
    generator = torch.Generator(device=cuda).manual_seed(0)
    x = torch.randn(256, 512, device=cuda, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(384, 512, device=cuda, generator=generator) * 0.05).bfloat16().requires_grad_()
    y = FP8Matmul(scaling, grad_format=E5M2 if scaling == "tensorwise" else E4M3)(x, weight)
    y.float().square().sum().backward()
    reference = F.linear(x.detach().float(), weight.detach().float())
    assert y.dtype == torch.bfloat16
    assert ((y.float() - reference).norm() / reference.norm()) < 0.05
    assert x.grad is not None and torch.isfinite(weight.grad).all()


@pytest.mark.gpu
def test_misaligned_token_count_is_rejected_on_gpu(cuda):
    with pytest.raises(ValueError, match="divisible by 16"):
        FP8Matmul()(torch.randn(10, 32, device=cuda, dtype=torch.bfloat16),
                    torch.randn(32, 32, device=cuda, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_native_fp8_model_on_gpu_stays_close_to_bf16(config_of, batch_of, cuda, scaling):
    config = config_of("qwen3")
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32  # FP8 GEMM alignment
    input_ids, cu_seqlens = (t.to(cuda) for t in batch_of((48, 80), config.vocab_size))
    targets = input_ids.roll(-1)[:, None]
    models = {name: from_config(config, backend=backend, dtype=torch.bfloat16, device=cuda, seed=0)
              for name, backend in (("bf16", "bf16"), ("fp8", NativeFP8Backend(scaling)))}
    with torch.no_grad():
        logp = {name: F.log_softmax(m.logits(input_ids, cu_seqlens).float(), -1).gather(1, targets)
                for name, m in models.items()}
    delta = (logp["fp8"] - logp["bf16"]).abs()
    print(f"native {scaling} vs bf16 on GPU: mean |dlogp| {delta.mean():.4f}, max {delta.max():.4f}")
    assert delta.mean() < 0.05 and delta.max() < 0.5
