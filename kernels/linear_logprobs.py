"""``fused_linear_logprobs``: per-token log-prob and entropy of an LM head without materialising logits.

Math (``z = W h_t / τ`` over the vocabulary, accumulated in fp32)::

    logp_t    = z_{y_t} − logsumexp(z)          (clamped ≤ 0)
    entropy_t = −Σ_v p_v log p_v = logsumexp(z) − Σ_v p_v z_v

Gradients for arbitrary per-token upstream ``g_lp``, ``g_H`` (logits recomputed in backward)::

    ∂/∂z_v = g_lp·(onehot_v − p_v) − g_H·p_v·(z_v − Σ_u p_u z_u),   ∂/∂logits = (1/τ)·∂/∂z

Execution: CUDA tensors run the Triton kernels (``linear_logprobs_triton``); CPU tensors run chunked PyTorch
(``linear_logprobs_cpu``). ``REDLINE_KERNELS_BACKEND`` overrides the choice (tests run the Triton kernels on
CPU tensors in Triton's interpreter that way).
The op is registered as ``torch.ops.redline.linear_logprobs`` (with a fake implementation and autograd), so
``torch.compile`` treats it as one opaque node. With ``tp_group`` the call runs eagerly (collectives inside).
"""

import math
from types import ModuleType
from typing import Optional

import torch

from . import linear_logprobs_cpu
from .backend import choose, import_triton_module
from .vocab_stats import RowStats, all_reduce, finalize

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def backend_for(device: torch.device) -> ModuleType:
    """The implementation module for tensors on ``device`` (see ``redline.kernels.backend``)."""
    if choose(device) == "torch":
        return linear_logprobs_cpu
    return import_triton_module("linear_logprobs_triton")


def check_inputs(hidden, weight, targets, mask, temperature) -> None:
    """Raise ValueError naming the argument when shapes, dtypes or devices do not fit the contract."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H] with H={hidden.shape[1]} (hidden's), got {tuple(weight.shape)}")
    if hidden.dtype not in FLOAT_DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight must share one dtype of {FLOAT_DTYPES}, got hidden {hidden.dtype} "
                         f"and weight {weight.dtype}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be [T]={hidden.shape[0]} int64, got {tuple(targets.shape)} {targets.dtype}")
    if mask is not None and (mask.shape != hidden.shape[:1] or mask.dtype != torch.bool):
        raise ValueError(f"mask must be [T]={hidden.shape[0]} bool, got {tuple(mask.shape)} {mask.dtype}")
    for name, t in (("weight", weight), ("targets", targets), ("mask", mask)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def selected_rows(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``[R]`` int64 indices of the True rows, or None for all rows (no mask, or every row True: no gathers)."""
    # One device→host sync (the count of valid rows) buys skipping every masked row's GEMM work.
    if mask is None:
        return None
    rows = mask.nonzero().squeeze(1)
    return None if rows.numel() == mask.numel() else rows


def scatter_rows(values: torch.Tensor, rows: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """``[n]`` with ``values`` at ``rows`` and 0 elsewhere (``rows`` None: values as they are)."""
    if rows is None:
        return values
    return values.new_zeros(n).index_copy_(0, rows, values)


def gather_rows(values: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``values[rows]`` as contiguous fp32 (None stays None; ``rows`` None: all rows)."""
    if values is None:
        return None
    values = values.float().contiguous()
    return values if rows is None else values.index_select(0, rows)


def vocab_offset(weight: torch.Tensor, group) -> int:
    """The global id of this rank's first vocabulary row (0 without tensor parallelism)."""
    if group is None:
        return 0
    import torch.distributed as dist

    return dist.get_rank(group) * weight.shape[0]


def forward_impl(hidden, weight, targets, mask, temperature: float, group=None, workspace_bytes=None):
    """(logp, entropy, lse), each ``[T]`` fp32, zero at masked rows. See the module docstring.

    ``workspace_bytes``: the logits workspace (None: the backend's ``WORKSPACE_BYTES``)."""
    rows = selected_rows(mask)
    backend = backend_for(hidden.device)
    stats = backend.forward_stats(hidden, weight, targets, rows, 1.0 / temperature, vocab_offset(weight, group),
                                  workspace_bytes=workspace_bytes or backend.WORKSPACE_BYTES)
    if group is not None:
        stats = all_reduce(stats, group)
    return tuple(scatter_rows(t, rows, hidden.shape[0]) for t in finalize(RowStats(*stats)))


def backward_impl(hidden, weight, targets, mask, lse, entropy, grad_logp, grad_entropy, temperature: float,
                  group=None, workspace_bytes=None):
    """(d_hidden, d_weight); with ``group`` d_hidden is summed over the tensor-parallel ranks."""
    rows = selected_rows(mask)
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    backend = backend_for(hidden.device)
    d_hidden, d_weight = backend.backward(
        hidden, weight, targets, rows, gather_rows(lse, rows), gather_rows(entropy, rows),
        gather_rows(grad_logp, rows), gather_rows(grad_entropy, rows), 1.0 / temperature, vocab_offset(weight, group),
        workspace_bytes=workspace_bytes or backend.WORKSPACE_BYTES)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(d_hidden, group=group)
    return d_hidden, d_weight


@torch.library.custom_op("redline::linear_logprobs", mutates_args=())
def _linear_logprobs_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        mask: Optional[torch.Tensor], temperature: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward_impl(hidden, weight, targets, mask, temperature)


@_linear_logprobs_op.register_fake
def _(hidden, weight, targets, mask, temperature):
    return tuple(hidden.new_empty(hidden.shape[:1], dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("redline::linear_logprobs_backward", mutates_args=())
def _linear_logprobs_backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 mask: Optional[torch.Tensor], lse: torch.Tensor, entropy: torch.Tensor,
                                 grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    return backward_impl(hidden, weight, targets, mask, lse, entropy, grad_logp, grad_entropy, temperature)


@_linear_logprobs_backward_op.register_fake
def _(hidden, weight, targets, mask, lse, entropy, grad_logp, grad_entropy, temperature):
    return torch.empty_like(hidden), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, mask, temperature = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, mask, lse, entropy)
    ctx.temperature = temperature


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, targets, mask, lse, entropy = ctx.saved_tensors
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return None, None, None, None, None
    d_hidden, d_weight = _linear_logprobs_backward_op(hidden, weight, targets, mask, lse, entropy, grad_logp,
                                                      grad_entropy, ctx.temperature)
    return d_hidden, d_weight, None, None, None


_linear_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


class _LinearLogprobsTP(torch.autograd.Function):
    """Vocab-parallel variant: collectives inside, so it runs eagerly (no custom-op registration)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, temperature, group):
        logp, entropy, lse = forward_impl(hidden, weight, targets, mask, temperature, group)
        ctx.save_for_backward(hidden, weight, targets, mask, lse, entropy)
        ctx.temperature, ctx.group = temperature, group
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        hidden, weight, targets, mask, lse, entropy = ctx.saved_tensors
        d_hidden, d_weight = backward_impl(hidden, weight, targets, mask, lse, entropy, grad_logp, grad_entropy,
                                           ctx.temperature, ctx.group)
        return d_hidden, d_weight, None, None, None, None


@torch.compiler.disable
def _linear_logprobs_tp(hidden, weight, targets, mask, temperature, group):
    return _LinearLogprobsTP.apply(hidden, weight, targets, mask, temperature, group)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          temperature: float = 1.0, mask: Optional[torch.Tensor] = None,
                          return_entropy: bool = False, tp_group=None
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``(logp [T] fp32, entropy [T] fp32 or None)`` of ``log_softmax(W h / temperature)``.

    hidden ``[T, H]`` bf16/fp16/fp32; weight ``[V, H]`` same dtype (with ``tp_group``: this rank's contiguous
    vocab shard ``[V/tp, H]``, rank r holding ids ``r·V/tp …``); targets ``[T]`` int64 global token ids;
    mask ``[T]`` bool — False rows cost no GEMM work and return logp 0, entropy 0, zero gradient.
    Differentiable w.r.t. hidden and weight for any per-token upstream gradients of logp and entropy.
    A target outside the vocabulary yields logp NaN. Memory beyond inputs, outputs and gradients: at most
    256 MiB in the forward and in the backward, the per-row state (20–44 bytes per token) included, as long as
    that state leaves room for one chunk (T up to a few million tokens at 256 MiB); beyond, the smallest chunks
    run and the state comes on top.
    """
    check_inputs(hidden, weight, targets, mask, temperature)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    temperature = float(temperature)
    if tp_group is None:
        logp, entropy, _ = _linear_logprobs_op(hidden, weight, targets, mask, temperature)
    else:
        logp, entropy, _ = _linear_logprobs_tp(hidden, weight, targets, mask, temperature, tp_group)
    return logp, (entropy if return_entropy else None)
