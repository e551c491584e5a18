"""One entry point for FP8 current-scaling casts: Triton kernels on CUDA, the PyTorch contract elsewhere."""

import torch

from redline.trainer.fp8.scaling import FP8Format, Quantized, quantize_reference


def quantize(x: torch.Tensor, fmt: FP8Format, *, rowwise: bool = False, pow2: bool = False,
             transpose: bool = False) -> Quantized:
    """Quantise a 2-D ``x [R, C]`` (any strides) to ``fmt``: tensorwise (optionally also writing the ``[C, R]``
    transpose) or per row. Same bytes on every device (see ``scaling``)."""
    if not x.is_cuda:
        return quantize_reference(x, fmt, rowwise=rowwise, pow2=pow2, transpose=transpose)
    from redline.trainer.fp8 import cast

    if rowwise:
        return cast.rowwise_cast(x, fmt, pow2=pow2)
    x = x.contiguous()
    return cast.cast_transpose(x, cast.tensor_amax(x), fmt, pow2=pow2, transpose=transpose)
