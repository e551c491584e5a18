"""``fused_linear_policy_loss``: hidden states → RL policy loss, with dHidden and dW produced in the forward call.

Math: ``loss = policy_loss(logp, old_logp, advantages, mask, cfg=cfg, entropy=entropy, ...)`` where
``(logp, entropy) = fused_linear_logprobs(hidden, weight, targets, temperature=...)``; the loss definition is
``redline.kernels.reference.policy_loss_reference`` (``linear_policy_loss_reference`` for the whole chain).

Execution, all inside the forward call (the autograd backward only scales the saved gradients by the
upstream scalar, so no activations are kept):
  1. ``linear_logprobs.forward_impl``: logp, entropy, lse of every selected token (2·T·H·V FLOPs, logits
     never materialised);
  2. the ``policy_loss_grads`` implementation: loss, metrics and d loss/d logp, d loss/d entropy per token. Every estimator —
     GSPO included, whose per-sequence mean of logp − old_logp needs all of a sequence's logp before any
     token's gradient is known — gets its exact gradient because step 1 finished for all tokens first;
  3. ``linear_logprobs.backward_impl`` with those per-token gradients: recomputed logits, dz, dHidden, dW
     (6·T·H·V FLOPs) in the same bounded workspace.
That is 8·T·H·V FLOPs. A one-pass 6·T·H·V variant for token-level estimators (keeping a token chunk's
full-vocabulary logits between the statistics and dz) is not implemented: within a 256 MiB workspace a
chunk holds ~440 tokens at V=151936, and the dW read-modify-write per chunk (2.5 GB each at H=4096) would
cost more than the recompute it saves.
"""

from typing import Optional

import torch

from .linear_logprobs import backward_impl, check_inputs, forward_impl
from .loss_config import LossConfig, check_policy_loss_inputs
from .policy_loss import CONFIG_FIELDS, _config
from .policy_loss import _implementation as policy_loss_implementation
from .reference import METRIC_NAMES


def _loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens,
                    cfg: LossConfig, temperature: float, group=None):
    """(loss [], metrics [len(METRIC_NAMES)], d_hidden, d_weight), all computed now."""
    logp, entropy, lse = forward_impl(hidden, weight, targets, mask, temperature, group)
    check_policy_loss_inputs(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp,
                             entropy=entropy, cu_seqlens=cu_seqlens)
    # The loss implementation directly, not the redline::policy_loss op: a custom op called from inside this
    # one's implementation failed in torch 2.11's dispatcher ("vector::reserve").
    loss, metrics, dlogp, dentropy = policy_loss_implementation(logp.device)(
        logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp, entropy=entropy,
        cu_seqlens=cu_seqlens)
    grad_entropy = dentropy if cfg.entropy_coef != 0 else None
    d_hidden, d_weight = backward_impl(hidden, weight, targets, mask, lse, entropy, dlogp, grad_entropy,
                                       temperature, group)
    return loss, metrics, d_hidden, d_weight


@torch.library.custom_op("redline::linear_policy_loss", mutates_args=())
def _linear_policy_loss_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                           ref_logp: Optional[torch.Tensor], rollout_logp: Optional[torch.Tensor],
                           cu_seqlens: Optional[torch.Tensor], temperature: float, estimator: str, eps_clip: float,
                           eps_clip_high: float, eps_clip_c: Optional[float], kl_type: str, kl_coef: float,
                           entropy_coef: float, tis: Optional[str], tis_clip_low: Optional[float],
                           tis_clip: Optional[float], agg: str, agg_constant: Optional[float]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _config(estimator, eps_clip, eps_clip_high, eps_clip_c, kl_type, kl_coef, entropy_coef, tis, tis_clip_low,
                  tis_clip, agg, agg_constant)
    return _loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens,
                           cfg, temperature)


@_linear_policy_loss_op.register_fake
def _(hidden, weight, *args):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(len(METRIC_NAMES), dtype=torch.float32),
            torch.empty_like(hidden), torch.empty_like(weight))


def _setup_context(ctx, inputs, output):
    _, metrics, d_hidden, d_weight = output
    ctx.save_for_backward(d_hidden, d_weight)
    ctx.mark_non_differentiable(metrics, d_hidden, d_weight)


def _scaled(grad_loss, d_hidden, d_weight):
    # In place: the saved gradients are used once, and a copy would double the gradient memory.
    return d_hidden.mul_(grad_loss), d_weight.mul_(grad_loss)


def _backward(ctx, grad_loss, _grad_metrics, _grad_dh, _grad_dw):
    d_hidden, d_weight = _scaled(grad_loss, *ctx.saved_tensors)
    return (d_hidden, d_weight) + (None,) * (len(CONFIG_FIELDS) + 8)


_linear_policy_loss_op.register_autograd(_backward, setup_context=_setup_context)


class _LinearPolicyLossTP(torch.autograd.Function):
    """Vocab-parallel variant: collectives inside, so it runs eagerly (no custom-op registration)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens, cfg,
                temperature, group):
        loss, metrics, d_hidden, d_weight = _loss_and_grads(hidden, weight, targets, old_logp, advantages, mask,
                                                            ref_logp, rollout_logp, cu_seqlens, cfg, temperature,
                                                            group)
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        return _scaled(grad_loss, *ctx.saved_tensors) + (None,) * 10


@torch.compiler.disable
def _linear_policy_loss_tp(*args):
    return _LinearPolicyLossTP.apply(*args)


def fused_linear_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                             cfg: LossConfig, temperature: float = 1.0, ref_logp: Optional[torch.Tensor] = None,
                             rollout_logp: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                             tp_group=None) -> tuple[torch.Tensor, dict]:
    """RL policy loss straight from the LM head's input: ``(loss [] fp32, metrics {name: [] fp32})``.

    hidden ``[T, H]``, weight ``[V, H]`` (with ``tp_group``: this rank's vocab shard, targets global ids),
    targets ``[T]`` int64, mask ``[T]`` bool; old_logp, advantages, ref_logp, rollout_logp ``[T]`` fp32;
    cu_seqlens ``[S+1]`` int32 — as ``policy_loss``. The entropy used for ``cfg.entropy_coef`` and the
    ``entropy`` metric is that of the temperature-scaled distribution. The loss is differentiable w.r.t.
    hidden and weight; their gradients are computed during this call (see the module docstring), so a
    backward of ``c·loss`` costs only a scale.
    """
    check_inputs(hidden, weight, targets, mask, temperature)
    if mask is None:
        raise ValueError("mask is required ([T] bool, True = the token is trained on)")
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    if tp_group is not None:
        loss, metrics = _linear_policy_loss_tp(hidden, weight, targets, old_logp, advantages, mask, ref_logp,
                                               rollout_logp, cu_seqlens, cfg, float(temperature), tp_group)
        return loss, dict(zip(METRIC_NAMES, metrics.unbind()))
    loss, metrics, _, _ = _linear_policy_loss_op(hidden, weight, targets, old_logp, advantages, mask, ref_logp,
                                                 rollout_logp, cu_seqlens, float(temperature),
                                                 *(getattr(cfg, f) for f in CONFIG_FIELDS))
    return loss, dict(zip(METRIC_NAMES, metrics.unbind()))
