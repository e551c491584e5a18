"""Plain-PyTorch building blocks shared by the ``bf16`` and ``native`` backends.

Every linear-like module here follows one parameter contract that ``redline.trainer.models.hf`` (export,
loading) and ``redline.trainer.parallel`` (sharding) rely on, whichever backend built it:

* ``NormLinear``: ``norm_weight [in]``, ``weight [out, in]``, ``bias [out]`` or None, ``out_parts`` (the
  sizes of the fused outputs along ``out``, e.g. ``(q, k, v)``), ``eps``; ``normalize(x)`` then
  ``project(x)`` is the forward.
* ``Linear``: ``weight [out, in]``, ``bias [out]`` or None; ``project(x, with_bias)``.

The matrix product itself is a swappable function (``matmul``) so the native FP8 backend reuses these modules
with its ``torch._scaled_mm`` product instead of ``F.linear``.

RMSNorm and SwiGLU run fused Triton kernels on CUDA tensors (``rms_norm_triton``, ``swiglu_triton``: one
kernel each way instead of a chain of eager elementwise ops) and the eager definitions here on other devices,
so CPU results stay bit-identical to transformers' (the HF parity tests rely on it).
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from redline.extras import importable

# (x [..., in], weight [out, in]) -> [..., out]
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` with the statistics in fp32, then back to ``x.dtype``.

    The order of the casts follows the HF Llama/Qwen implementation so bf16 outputs match it bit for bit.
    """
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [..., 2I]`` holding ``gate`` then ``up`` along the last dim -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def runs_triton(x: torch.Tensor) -> bool:
    """True when the fused Triton kernels serve ``x``: a CUDA tensor, with triton importable."""
    return x.is_cuda and importable("triton")


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm``: ``rms_norm_triton`` on CUDA (same bf16 output up to a rare last-bit difference, see there),
    the eager ``rms_norm`` itself elsewhere."""
    if not runs_triton(x):
        return rms_norm(x, weight, eps)
    from redline.trainer.layers.rms_norm_triton import rms_norm_triton

    return rms_norm_triton(x, weight, eps)


def fused_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``swiglu``: ``swiglu_triton`` on CUDA (one rounding instead of two: within about an ulp, see there), the
    eager ``swiglu`` itself elsewhere."""
    if not runs_triton(gate_up):
        return swiglu(gate_up)
    from redline.trainer.layers.swiglu_triton import swiglu_triton

    return swiglu_triton(gate_up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """``y = x W^T + b``; ``weight [out, in]``. ``project(x, with_bias=False)`` lets a row-parallel wrapper add
    the bias after its reduction."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, matmul: Matmul = F.linear,
                 dtype=None, device=None):
        super().__init__()
        self.matmul = matmul
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    def project(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        return y + self.bias if with_bias and self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class NormLinear(Linear):
    """RMSNorm followed by a (fused) projection: ``project(normalize(x))``.

    ``out_parts`` names how the fused output splits, e.g. ``(q_dim, kv_dim, kv_dim)`` for QKV or
    ``(intermediate, intermediate)`` for gate/up; tensor parallelism shards each part separately.
    """

    def __init__(self, in_features: int, out_parts: Sequence[int], *, bias: bool, eps: float,
                 matmul: Matmul = F.linear, dtype=None, device=None):
        super().__init__(in_features, sum(out_parts), bias=bias, matmul=matmul, dtype=dtype, device=device)
        self.out_parts = tuple(out_parts)
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(in_features, dtype=dtype, device=device))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.norm_weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.normalize(x))
