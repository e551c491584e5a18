"""FP8 current-scaling numerics in plain PyTorch: the contract the Triton casts reproduce bit for bit.

Formulas follow TransformerEngine's ``Float8CurrentScaling`` (see shared/reference/fp8.md, section 2.4):

* ``amax = max |x|`` (fp32) over the tensor (tensorwise) or over each row (rowwise);
* ``scale = fp8_max / amax`` as a correctly rounded fp32 division; ``scale = 1`` when ``amax`` is 0, inf or
  NaN; ``scale = FLT_MAX`` when the division overflows; optionally floored to a power of two;
* ``data = saturate(x * scale)`` rounded to nearest even; the GEMM consumes ``scale_inv = 1 / scale``.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

FLT_MAX = torch.finfo(torch.float32).max
POW2_MASK = -8388608  # 0xFF800000 as int32: keeps sign and exponent, i.e. floors to a power of two


@dataclass(frozen=True)
class FP8Format:
    dtype: torch.dtype
    max: float


E4M3 = FP8Format(torch.float8_e4m3fn, 448.0)
E5M2 = FP8Format(torch.float8_e5m2, 57344.0)


class Quantized(NamedTuple):
    """``data`` FP8 ``[R, C]`` row-major; ``scale_inv`` fp32 ``[]`` (tensorwise) or ``[R, 1]`` (rowwise);
    ``data_t`` the ``[C, R]`` row-major transpose (tensorwise only, when asked for)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None = None


def scale_from_amax(amax: torch.Tensor, fp8_max: float, pow2: bool = False) -> torch.Tensor:
    """fp32 quantisation scale(s) from fp32 amax(es), same shape."""
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(usable, torch.full_like(amax, fp8_max) / torch.where(usable, amax, 1.0), 1.0)
    scale = torch.where(torch.isinf(scale), FLT_MAX, scale)
    if pow2:
        scale = (scale.view(torch.int32) & POW2_MASK).view(torch.float32)
    return scale


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """``saturate(x * scale)`` in ``fmt`` (explicit clamp: eager casts did not saturate before torch 2.12)."""
    return (x.float() * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def amax_of(x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    return x.abs().amax(dim=-1, keepdim=True).float() if rowwise else x.abs().amax().float()


def quantize_reference(x: torch.Tensor, fmt: FP8Format, *, rowwise: bool = False, pow2: bool = False,
                       transpose: bool = False, amax_group: dist.ProcessGroup | None = None) -> Quantized:
    """Current-scaling quantisation of a 2-D ``x [R, C]``; ``amax_group`` all-reduces (MAX) a tensorwise amax
    first so every rank of e.g. a sequence-parallel group shares one scale."""
    amax = amax_of(x, rowwise)
    if amax_group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
    scale = scale_from_amax(amax, fmt.max, pow2)
    data = cast_with_scale(x, scale, fmt)
    return Quantized(data, torch.reciprocal(scale), data.t().contiguous() if transpose else None)
