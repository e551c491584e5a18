"""``scale_``: multiply a CUDA tensor in place by a scalar that lives on the device, without a host sync.

Each program reads the scale first and returns when it is exactly 1 — the usual upstream gradient of a loss —
so the common case moves no memory (multiplying the gradients of a 151936 × 4096 bf16 LM head by 1 took 2.6 ms
on the H100 through ``Tensor.mul_``; ``benchmarks/results/lm_head/profile-policy-h100-T4096.txt``).
"""

import torch
import triton
import triton.language as tl

BLOCK = 8192


@triton.jit
def _scale_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + offs, mask=keep)
        tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x.dtype), mask=keep)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x *= scale`` in place (fp32 arithmetic, rounded to x's dtype) and return x; x contiguous, scale a
    one-element float tensor on x's device."""
    if not x.is_contiguous() or scale.numel() != 1 or scale.device != x.device:
        raise ValueError(f"scale_ needs a contiguous x and a one-element scale on its device, got x strides "
                         f"{x.stride()}, scale of {scale.numel()} elements on {scale.device}")
    if x.numel():
        _scale_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, scale, x.numel(), BLOCK=BLOCK, num_warps=8)
    return x
