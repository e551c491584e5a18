"""Fused SwiGLU on the gate/up projection's output: one Triton kernel forward, one backward
(``torch_layers.swiglu`` is the definition).

``gate_up [..., 2I]`` holds ``gate`` in its first ``I`` columns and ``up`` in its last ``I``; with ``s =
sigmoid(gate)``, all in fp32::

    out = gate * s * up                                      [..., I], rounded once to gate_up.dtype
    d_gate = d_out * up * s * (1 + gate * (1 - s))
    d_up = d_out * gate * s

The gradients are written into one ``[..., 2I]`` tensor (no concatenation). The eager ``F.silu(gate) * up``
rounds ``silu(gate)`` to the input dtype before the product, so in bf16 the two differ by about one ulp of
the output (this one is the more accurate); in fp32 they agree to fp32 rounding. Reads ``gate_up`` and
``d_out`` with any row stride; runs on CUDA tensors, and on CPU under ``TRITON_INTERPRET=1``.
"""

import torch

from redline.extras import require
from redline.trainer.layers.triton_rounding import round_to

triton = require("triton", "the fused SwiGLU")
tl = triton.language

BLOCK = 1024  # columns per program; the grid is (rows, column blocks)


@triton.jit
def _swiglu_fwd_kernel(gate_up_ptr, out_ptr, stride_row, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(d_out_ptr, gate_up_ptr, d_gate_up_ptr, stride_d_out, stride_row, inter,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    d_out = tl.load(d_out_ptr + row * stride_d_out + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(gate)
    d_gate = d_out * up * s * (1.0 + gate * (1.0 - s))
    d_up = d_out * gate * s
    dtype = d_gate_up_ptr.dtype.element_ty
    tl.store(d_gate_up_ptr + row * 2 * inter + cols, round_to(d_gate, dtype), mask=mask)
    tl.store(d_gate_up_ptr + row * 2 * inter + inter + cols, round_to(d_up, dtype), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., C]`` as ``[R, C]`` with unit column stride (a view when the leading dims allow one)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up must hold gate and up halves of equal width, got {gate_up.shape[-1]} columns")
        inter = gate_up.shape[-1] // 2
        rows2d = _rows(gate_up)
        out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
        _swiglu_fwd_kernel[(rows2d.shape[0], triton.cdiv(inter, BLOCK))](rows2d, out, rows2d.stride(0), inter,
                                                                          BLOCK=BLOCK)
        ctx.save_for_backward(rows2d)
        ctx.shape = gate_up.shape
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor) -> torch.Tensor:
        (rows2d,) = ctx.saved_tensors
        inter = rows2d.shape[-1] // 2
        d_out2d = _rows(d_out)
        d_gate_up = torch.empty(ctx.shape, dtype=rows2d.dtype, device=rows2d.device)
        _swiglu_bwd_kernel[(rows2d.shape[0], triton.cdiv(inter, BLOCK))](
            d_out2d, rows2d, d_gate_up, d_out2d.stride(0), rows2d.stride(0), inter, BLOCK=BLOCK)
        return d_gate_up


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``torch_layers.swiglu`` as fused kernels: ``gate_up [..., 2I]`` (any row stride) fp32/bf16/fp16 ->
    ``silu(gate) * up [..., I]`` contiguous, same dtype; see the module docstring for the numerics."""
    return SwiGLUFunction.apply(gate_up)
