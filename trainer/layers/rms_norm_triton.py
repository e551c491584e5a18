"""Fused RMSNorm: one Triton kernel forward, one backward (``torch_layers.rms_norm`` is the definition).

Forward, per row of ``x [..., N]`` and ``weight [N]``::

    rstd = rsqrt(sum(x^2) * (1/N) + eps)                      fp32
    normed = (x * rstd).to(x.dtype)                          rounded once, as the eager code does
    out = (weight * normed).to(promote(weight, x))           fp32 product of the two rounded values

The product of two bf16 (or fp16) values is exact in fp32, so rounding it once equals the eager bf16 multiply:
the output is the eager output bit for bit wherever the fp32 ``rstd`` is. ``rstd`` can differ from the eager
one in its last bit (summation order, rsqrt implementation), which moves ``normed`` by one ulp of ``x.dtype``
and the output by at most two, where ``x * rstd`` lies next to a rounding boundary: 119 of 67M elements at
16384 x 4096 random bf16 on an H100. fp32 inputs agree to fp32 rounding.
``rstd [rows] fp32`` is saved for backward.

Backward (fp32 math, ``n = x * rstd`` unrounded, ``dn = dy * weight``)::

    dx = rstd * (dn - n * sum(dn * n) / N)
    dweight = sum over rows of dy * normed                   normed rounded as in forward: its true input

``dweight`` is summed per program over a fixed set of row blocks, then over programs by ``torch.sum``: the
same bits on every run. Within fp32 rounding of the exact gradient (the eager autograd rounds ``dn`` and
``dweight``'s terms to ``x.dtype`` on the way, so bf16 gradients differ from it by bf16 rounding).

Rows are addressed as ``[A, B]`` with two strides, so a per-head view ``[T, heads, head_dim]`` of a fused QKV
output (rows not evenly spaced) is read in place. Runs on CUDA tensors, and on CPU under ``TRITON_INTERPRET=1``.
"""

import math

import torch

from redline.extras import require
from redline.trainer.layers.triton_rounding import round_to

triton = require("triton", "the fused RMSNorm")
tl = triton.language

MAX_N = 65536  # one row lives in registers
BLOCK_ELEMENTS = 4096  # elements per program: several short rows (q/k head norms) or one long row
BACKWARD_PROGRAMS = 512  # fixed (not per device) so dweight's sum order depends on the shape only


@triton.jit
def _row_offsets(row, inner, stride_outer, stride_inner):
    return (row // inner) * stride_outer + (row % inner) * stride_inner


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, rows, inner, sx_outer, sx_inner, n, inv_n, eps,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (row < rows)[:, None] & (cols < n)[None, :]
    x_at = _row_offsets(row, inner, sx_outer, sx_inner)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)
    normed = round_to(x * rstd[:, None], x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    out = w[None, :] * normed
    tl.store(out_ptr + row[:, None] * n + cols[None, :], round_to(out, out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=row < rows)


@triton.jit
def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, rows, inner, sx_outer, sx_inner,
                         sdy_outer, sdy_inner, n, inv_n, row_blocks, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for block in range(program, row_blocks, tl.num_programs(0)):
        row = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        mask = (row < rows)[:, None] & (cols < n)[None, :]
        x_at = _row_offsets(row, inner, sx_outer, sx_inner)[:, None] + cols[None, :]
        dy_at = _row_offsets(row, inner, sdy_outer, sdy_inner)[:, None] + cols[None, :]
        x = tl.load(x_ptr + x_at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
        normed = x * rstd[:, None]
        dw += tl.sum(dy * round_to(normed, x_ptr.dtype.element_ty).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        dx = (dn - normed * (tl.sum(dn * normed, axis=1) * inv_n)[:, None]) * rstd[:, None]
        tl.store(dx_ptr + row[:, None] * n + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_partial_ptr + program * n + cols, dw, mask=cols < n)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., N]`` as ``[A, B, N]`` with unit stride along ``N`` (a view when the leading dims allow one)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    lead = t.shape[:-1]
    return t.reshape(math.prod(lead[:-1]), lead[-1] if lead else 1, t.shape[-1])


def _launch_shape(n: int) -> tuple[int, int, int]:
    """``(ROWS, BLOCK_N, num_warps)`` for rows of ``n`` elements."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, BLOCK_ELEMENTS // block_n)
    return rows, block_n, min(16, max(4, rows * block_n // 512))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n = x.shape[-1]
        if weight.shape != (n,):
            raise ValueError(f"weight must be [{n}] to normalise x of shape {tuple(x.shape)}, got "
                             f"{tuple(weight.shape)}")
        if n > MAX_N:
            raise ValueError(f"the fused RMSNorm keeps a row in registers: N={n} is over {MAX_N}")
        x3 = _rows(x)
        rows = x3.shape[0] * x3.shape[1]
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block_rows, block_n, warps = _launch_shape(n)
        _rms_norm_fwd_kernel[(triton.cdiv(rows, block_rows),)](
            x3, weight, out, rstd, rows, x3.shape[1], x3.stride(0), x3.stride(1), n, 1.0 / n, eps,
            ROWS=block_rows, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x3, weight, rstd)
        ctx.x_shape = x.shape
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x3, weight, rstd = ctx.saved_tensors
        n, rows = x3.shape[-1], rstd.shape[0]
        dy3 = _rows(dy)
        dx = torch.empty(ctx.x_shape, dtype=x3.dtype, device=x3.device)
        block_rows, block_n, warps = _launch_shape(n)
        row_blocks = triton.cdiv(rows, block_rows)
        programs = min(row_blocks, BACKWARD_PROGRAMS)
        dw_partial = torch.empty(programs, n, dtype=torch.float32, device=x3.device)
        _rms_norm_bwd_kernel[(programs,)](
            dy3, x3, weight, rstd, dx, dw_partial, rows, x3.shape[1], x3.stride(0), x3.stride(1), dy3.stride(0),
            dy3.stride(1), n, 1.0 / n, row_blocks, ROWS=block_rows, BLOCK_N=block_n,
            num_warps=warps)
        return dx, dw_partial.sum(0).to(weight.dtype), None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch_layers.rms_norm`` as fused kernels: ``x [..., N]`` (any strides) fp32/bf16/fp16, ``weight [N]``
    -> ``[..., N]`` contiguous in ``promote(x.dtype, weight.dtype)``; see the module docstring for the numerics."""
    return RMSNormFunction.apply(x, weight, eps)
