"""FP8 linear layers on ``torch._scaled_mm`` with current scaling, and the ``native`` layer backend.

``y = x W^T`` with ``x [M, K]``, ``W [N, K]``; FP8 GEMMs for all three products (TE's HYBRID format by default:
E4M3 activations and weights, E5M2 gradients):

* fprop ``y = x8 · w8^T``      (fast accumulation, as TE's fprop)
* dgrad ``dx = g8 · w8``       (split accumulation)
* wgrad ``dW = g8^T · x8``     (split accumulation; tokens are the contraction dim)

Hopper's FP8 GEMM is TN-only, so dgrad needs ``W^T`` and wgrad needs ``g^T`` and ``x^T`` as row-major FP8
copies. Tensorwise: one scale per tensor, so the transposes are the same bytes re-laid out, written by the
cast kernel itself. Rowwise (one scale per row along the contraction dim, power-of-two scales as torchao's
``rowwise`` recipe): each GEMM contracts a different dim, so the backward re-quantises the saved
high-precision ``x`` and ``W`` along the other axis (a transpose fused into the row cast).
Leading dims must be multiples of 16 on CUDA (cuBLASLt FP8); pad packed batches to that.
"""

import torch

from redline.trainer.fp8.quantize import quantize
from redline.trainer.fp8.scaling import E4M3, E5M2, FP8Format
from redline.trainer.layers import LayerBackend

SCALINGS = ("tensorwise", "rowwise")
CUDA_ALIGNMENT = 16


def _mm(a, b_col_major, scale_a, scale_b, out_dtype, fast_accum):
    return torch._scaled_mm(a, b_col_major, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class TensorwiseFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, grad_format: FP8Format):
        xq = quantize(x, E4M3, transpose=weight.requires_grad)
        wq = quantize(weight, E4M3, transpose=x.requires_grad)
        ctx.save_for_backward(xq.data_t, xq.scale_inv, wq.data_t, wq.scale_inv)
        ctx.grad_format = grad_format
        return _mm(xq.data, wq.data.t(), xq.scale_inv, wq.scale_inv, x.dtype, True)

    @staticmethod
    def backward(ctx, grad):
        x_t, x_scale_inv, w_t, w_scale_inv = ctx.saved_tensors
        gq = quantize(grad, ctx.grad_format, transpose=ctx.needs_input_grad[1])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm(gq.data, w_t.t(), gq.scale_inv, w_scale_inv, grad.dtype, False)
        if ctx.needs_input_grad[1]:
            dw = _mm(gq.data_t, x_t.t(), gq.scale_inv, x_scale_inv, grad.dtype, False)
        return dx, dw, None


class RowwiseFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, grad_format: FP8Format):
        xq = quantize(x, E4M3, rowwise=True, pow2=True)
        wq = quantize(weight, E4M3, rowwise=True, pow2=True)
        ctx.save_for_backward(x, weight)
        ctx.grad_format = grad_format
        return _mm(xq.data, wq.data.t(), xq.scale_inv, wq.scale_inv.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        fmt = ctx.grad_format
        dx = dw = None
        if ctx.needs_input_grad[0]:  # contract over N: g per row, W per column
            gq = quantize(grad, fmt, rowwise=True, pow2=True)
            wq = quantize(weight.t(), E4M3, rowwise=True, pow2=True)
            dx = _mm(gq.data, wq.data.t(), gq.scale_inv, wq.scale_inv.t(), grad.dtype, False)
        if ctx.needs_input_grad[1]:  # contract over M (tokens): g and x per column
            gq = quantize(grad.t(), fmt, rowwise=True, pow2=True)
            xq = quantize(x.t(), E4M3, rowwise=True, pow2=True)
            dw = _mm(gq.data, xq.data.t(), gq.scale_inv, xq.scale_inv.t(), grad.dtype, False)
        return dx, dw, None


class FP8Matmul:
    """``(x [..., K], weight [N, K]) -> [..., N]`` through FP8 GEMMs; a drop-in for ``F.linear`` without bias."""

    def __init__(self, scaling: str = "tensorwise", grad_format: FP8Format = E5M2):
        if scaling not in SCALINGS:
            raise ValueError(f"scaling={scaling!r} is unknown; expected one of {SCALINGS}")
        self.scaling = scaling
        self.grad_format = grad_format
        self.function = TensorwiseFP8Matmul if scaling == "tensorwise" else RowwiseFP8Matmul

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.is_cuda and (x2d.shape[0] % CUDA_ALIGNMENT or x2d.shape[1] % CUDA_ALIGNMENT
                            or weight.shape[0] % CUDA_ALIGNMENT):
            raise ValueError(f"FP8 linear on CUDA needs token count, in and out features divisible by "
                             f"{CUDA_ALIGNMENT}; got x {tuple(x2d.shape)}, weight {tuple(weight.shape)} "
                             f"(pad the packed batch)")
        return self.function.apply(x2d, weight, self.grad_format).reshape(*x.shape[:-1], weight.shape[0])


class NativeFP8Backend(LayerBackend):
    """Plain-PyTorch layers whose linear products run in FP8 (``scaling="tensorwise" | "rowwise"``).

    Gradients default to E5M2 (TE's HYBRID) for tensorwise and to E4M3 for rowwise: PyTorch's rowwise FP8 GEMM
    (CUTLASS) takes E4M3 operands, the choice torchao's ``rowwise`` recipe makes too.
    """

    name = "native"
    token_alignment = CUDA_ALIGNMENT

    def __init__(self, scaling: str = "tensorwise", grad_format: str | None = None):
        formats = {"e5m2": E5M2, "e4m3": E4M3}
        if grad_format is None:
            grad_format = "e5m2" if scaling == "tensorwise" else "e4m3"
        if grad_format not in formats:
            raise ValueError(f"grad_format={grad_format!r} is unknown; expected one of {sorted(formats)}")
        super().__init__(FP8Matmul(scaling, formats[grad_format]))
