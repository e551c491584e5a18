"""Activation recompute per decoder layer: ``full`` (keep only the layer input) or ``selective`` (keep the
GEMM and attention outputs — async TP's fused GEMM + collective ones included — and recompute norms, RoPE,
SwiGLU and other elementwise work)."""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from redline.trainer.parallel.async_tp import fused_ops

MODES = ("none", "selective", "full")


# Outputs worth keeping: expensive to recompute relative to their size (async TP's fused ops: recomputing one
# would repeat its GEMM and its collective).
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
} | set(fused_ops())


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model, mode: str) -> None:
    """Wrap each layer's forward of ``model`` (a ``DecoderModel`` or pipeline stage) in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r} is unknown; expected one of {MODES}")
    if mode == "none":
        return
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if mode == "selective" else None)
    for layer in model.layers.values():
        plain = layer.forward
        options = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn else {})
        layer.forward = functools.partial(checkpoint, plain, **options)
