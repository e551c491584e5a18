"""Layer backends: who builds the linear layers and the core attention of a decoder.

``layer_backend(name, **options)`` returns a ``LayerBackend``:

* ``"bf16"``: plain PyTorch (any floating dtype, so also fp32 on CPU), no FP8.
* ``"native"``: the same modules with FP8 matrix products on ``torch._scaled_mm`` (``redline.trainer.fp8``);
  options ``scaling="tensorwise" | "rowwise"``.
* ``"te"``: TransformerEngine modules under ``te.autocast``; options ``recipe="delayed" | "current" | "block" |
  "mxfp8"`` and ``attention="auto" | "te" | "redline"`` (core attention: TE's when it runs fused/flash and
  matches, else redline's varlen attention; see ``te_layers``). Imported lazily; needs the ``te`` extra and a
  CUDA GPU.

Built modules follow the parameter contract in ``torch_layers`` (``norm_weight``, ``weight``, ``bias``,
``out_parts``), which export, loading and tensor parallelism rely on.
"""

import contextlib
from collections.abc import Sequence

import torch.nn.functional as F

from redline.trainer.layers.torch_layers import Linear, Matmul, NormLinear

BACKENDS = ("bf16", "native", "te")


class LayerBackend:
    """Plain-PyTorch layers with a pluggable matrix product; the ``bf16`` backend as is."""

    name = "bf16"
    token_alignment = 1  # packed token counts must be a multiple of this (FP8 GEMM / scaling-block shapes)

    def __init__(self, matmul: Matmul = F.linear):
        self.matmul = matmul

    def norm_linear(self, in_features: int, out_parts: Sequence[int], *, bias: bool, eps: float, dtype=None,
                    device=None):
        return NormLinear(in_features, out_parts, bias=bias, eps=eps, matmul=self.matmul, dtype=dtype,
                          device=device)

    def linear(self, in_features: int, out_features: int, *, bias: bool, dtype=None, device=None):
        return Linear(in_features, out_features, bias=bias, matmul=self.matmul, dtype=dtype, device=device)

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int):
        from redline.trainer.models.attention import VarlenAttention

        return VarlenAttention(head_dim)

    def autocast(self):
        """Context the forward pass runs in (TE's FP8 autocast; nothing for plain PyTorch)."""
        return contextlib.nullcontext()


def layer_backend(name: str, **options) -> LayerBackend:
    """The backend called ``name`` (one of ``BACKENDS``) configured with ``options``."""
    if name == "bf16":
        if options:
            raise ValueError(f"backend 'bf16' takes no options, got {sorted(options)}")
        return LayerBackend()
    if name == "native":
        from redline.trainer.fp8.linear import NativeFP8Backend

        return NativeFP8Backend(**options)
    if name == "te":
        from redline.trainer.layers.te_layers import TEBackend

        return TEBackend(**options)
    raise ValueError(f"backend={name!r} is unknown; expected one of {BACKENDS}")
