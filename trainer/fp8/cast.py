"""Triton FP8 casts: tensorwise (amax pass, then one fused scale + cast + transpose pass) and rowwise (per-row
amax + scale + cast in one program per row, reading any strides, so quantising along columns is the same
kernel on a transposed view: transpose fused into the cast).

Numerics are exactly ``redline.trainer.fp8.scaling`` (correctly rounded division and reciprocal, saturation,
round-to-nearest-even); the tests compare bytes under ``TRITON_INTERPRET=1``.
"""

import torch

from redline.extras import require
from redline.trainer.fp8 import scaling
from redline.trainer.fp8.scaling import FP8Format, Quantized

triton = require("triton", "native FP8 casts")
tl = triton.language

# Compiled Triton kernels read module globals only when they are constexpr (the interpreter reads any global)
FLT_MAX = tl.constexpr(scaling.FLT_MAX)
POW2_MASK = tl.constexpr(scaling.POW2_MASK)

AMAX_BLOCK = 4096
TILE = 64
ROW_BLOCK = 1024

TRITON_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _scale(amax, fp8_max, POW2: tl.constexpr):
    usable = (amax > 0) & (amax < float("inf"))  # also false for NaN
    scale = tl.where(usable, tl.math.div_rn(fp8_max + tl.zeros_like(amax), tl.where(usable, amax, 1.0)), 1.0)
    scale = tl.where(scale == float("inf"), FLT_MAX, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & POW2_MASK).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def _cast_transpose_kernel(x_ptr, amax_ptr, out_ptr, out_t_ptr, scale_inv_ptr, rows, cols, fp8_max,
                           POW2: tl.constexpr, WRITE_T: tl.constexpr, OUT_DTYPE: tl.constexpr, TILE: tl.constexpr):
    scale = _scale(tl.load(amax_ptr), fp8_max, POW2)
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)[:, None]
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)[None, :]
    inside = (r < rows) & (c < cols)
    x = tl.load(x_ptr + r * cols + c, mask=inside, other=0.0).to(tl.float32)
    q = tl.clamp(x * scale, -fp8_max, fp8_max).to(OUT_DTYPE, fp_downcast_rounding="rtne")
    tl.store(out_ptr + r * cols + c, q, mask=inside)
    if WRITE_T:
        tl.store(out_t_ptr + c * rows + r, q, mask=inside)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))


@triton.jit
def _rowwise_cast_kernel(x_ptr, out_ptr, scale_inv_ptr, cols, stride_r, stride_c, fp8_max, POW2: tl.constexpr,
                         OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_r + c * stride_c, mask=c < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = _scale(tl.max(amax, axis=0), fp8_max, POW2)
    for start in range(0, cols, BLOCK):
        c = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_r + c * stride_c, mask=c < cols, other=0.0).to(tl.float32)
        q = tl.clamp(x * scale, -fp8_max, fp8_max).to(OUT_DTYPE, fp_downcast_rounding="rtne")
        tl.store(out_ptr + row * cols + c, q, mask=c < cols)
    tl.store(scale_inv_ptr + row, tl.math.div_rn(1.0, scale))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of a contiguous tensor as a fp32 scalar tensor (one atomic-max reduction pass)."""
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    _amax_kernel[(triton.cdiv(x.numel(), AMAX_BLOCK),)](x, amax, x.numel(), BLOCK=AMAX_BLOCK)
    return amax


def cast_transpose(x: torch.Tensor, amax: torch.Tensor, fmt: FP8Format, *, pow2: bool = False,
                   transpose: bool = False) -> Quantized:
    """Tensorwise cast of a contiguous ``x [R, C]`` with the scale derived from ``amax`` (fp32 scalar), writing
    the ``[C, R]`` transpose from the same tiles when ``transpose``."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"cast_transpose expects a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    data = torch.empty(rows, cols, dtype=fmt.dtype, device=x.device)
    data_t = torch.empty(cols, rows, dtype=fmt.dtype, device=x.device) if transpose else data
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, TILE), triton.cdiv(cols, TILE))
    _cast_transpose_kernel[grid](x, amax, data, data_t, scale_inv, rows, cols, fmt.max, POW2=pow2,
                                 WRITE_T=transpose, OUT_DTYPE=TRITON_FP8[fmt.dtype], TILE=TILE)
    return Quantized(data, scale_inv, data_t if transpose else None)


def rowwise_cast(x: torch.Tensor, fmt: FP8Format, *, pow2: bool = False) -> Quantized:
    """Per-row scaled cast of a 2-D ``x [R, C]`` of any strides (pass ``t.t()`` to quantise ``t`` per column
    into a row-major transposed copy); ``scale_inv [R, 1]``."""
    if x.dim() != 2:
        raise ValueError(f"rowwise_cast expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    data = torch.empty(rows, cols, dtype=fmt.dtype, device=x.device)
    scale_inv = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _rowwise_cast_kernel[(rows,)](x, data, scale_inv, cols, x.stride(0), x.stride(1), fmt.max, POW2=pow2,
                                  OUT_DTYPE=TRITON_FP8[fmt.dtype], BLOCK=ROW_BLOCK)
    return Quantized(data, scale_inv)
