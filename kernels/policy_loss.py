"""RL policy loss (PPO / GSPO / CISPO + KL + entropy + TIS, four aggregations) with its gradients in one pass.

The exact math is ``redline.kernels.reference.policy_loss_reference``. The forward computes the loss and,
at the same time, ``d loss / d logp`` and ``d loss / d entropy`` per token, so backward is a scale.

CUDA tensors run two Triton launches (``policy_loss_triton``), CPU tensors vectorised PyTorch
(``policy_loss_torch``); ``REDLINE_KERNELS_BACKEND=torch|triton`` overrides the choice (``triton`` on CPU
tensors runs Triton's interpreter and needs ``TRITON_INTERPRET=1``). Under ``torch.compile`` the call is one
``torch.library`` custom op, ``torch.ops.redline.policy_loss``, one opaque node in the graph; eager calls go
through an ``autograd.Function`` over the same implementation and gradients (less host time per call).
"""

import dataclasses
import functools

import torch

from redline.kernels.loss_config import LossConfig, check_policy_loss_inputs
from redline.kernels.backend import choose, import_triton_module
from redline.kernels.policy_loss_torch import policy_loss_grads_torch
from redline.kernels.reference import METRIC_NAMES

def _implementation(device: torch.device):
    """The loss implementation for tensors on ``device`` (see ``redline.kernels.backend``)."""
    if choose(device) == "torch":
        return policy_loss_grads_torch
    return import_triton_module("policy_loss_triton").policy_loss_grads_triton


CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(LossConfig))


@functools.lru_cache(maxsize=64)
def _config(*values) -> LossConfig:
    return LossConfig(**dict(zip(CONFIG_FIELDS, values)))


# The config travels as plain scalars (not a LossConfig) because a custom op's schema takes only those;
# torch.compile then guards on each value.
@torch.library.custom_op("redline::policy_loss", mutates_args=())
def _policy_loss_op(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    ref_logp: torch.Tensor | None, rollout_logp: torch.Tensor | None, entropy: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, estimator: str, eps_clip: float, eps_clip_high: float,
                    eps_clip_c: float | None, kl_type: str, kl_coef: float, entropy_coef: float, tis: str | None,
                    tis_clip_low: float | None, tis_clip: float | None, agg: str,
                    agg_constant: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _config(estimator, eps_clip, eps_clip_high, eps_clip_c, kl_type, kl_coef, entropy_coef, tis, tis_clip_low,
                  tis_clip, agg, agg_constant)
    implementation = _implementation(logp.device)
    return implementation(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp,
                          entropy=entropy, cu_seqlens=cu_seqlens)


@_policy_loss_op.register_fake
def _(logp, *args):
    return (logp.new_empty(()), logp.new_empty(len(METRIC_NAMES)), torch.empty_like(logp), torch.empty_like(logp))


def _save(ctx, has_entropy: bool, metrics, dlogp, dentropy) -> None:
    ctx.has_entropy = has_entropy
    ctx.save_for_backward(dlogp, dentropy)
    ctx.mark_non_differentiable(metrics, dlogp, dentropy)


def _scaled_grads(ctx, grad_loss):
    """(d/d logp, d/d entropy or None): the saved per-token gradients times the upstream scalar."""
    dlogp, dentropy = ctx.saved_tensors
    return grad_loss * dlogp, (grad_loss * dentropy if ctx.has_entropy else None)


def _setup_context(ctx, inputs, output):
    _save(ctx, inputs[6] is not None, *output[1:])


def _backward(ctx, grad_loss, grad_metrics, grad_dlogp, grad_dentropy):
    grad_logp, grad_entropy = _scaled_grads(ctx, grad_loss)
    return (grad_logp, None, None, None, None, None, grad_entropy, None) + (None,) * len(CONFIG_FIELDS)


torch.library.register_autograd("redline::policy_loss", _backward, setup_context=_setup_context)


class _EagerPolicyLoss(torch.autograd.Function):
    """The eager path: the same implementation and gradients as ``redline::policy_loss`` without the custom
    op's dispatch, which cost ~0.45 ms of host time per forward + backward on the H100 machine (at 1M tokens
    the kernels themselves take ~45 µs). ``torch.compile`` sees the custom op instead."""

    @staticmethod
    def forward(ctx, logp, entropy, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens, cfg):
        loss, metrics, dlogp, dentropy = _implementation(logp.device)(
            logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp, entropy=entropy,
            cu_seqlens=cu_seqlens)
        _save(ctx, entropy is not None, metrics, dlogp, dentropy)
        return loss, metrics, dlogp, dentropy

    @staticmethod
    def backward(ctx, grad_loss, grad_metrics, grad_dlogp, grad_dentropy):
        return _scaled_grads(ctx, grad_loss) + (None,) * 7  # old_logp … cfg: no gradient


def policy_loss_grads(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                      entropy=None, cu_seqlens=None):
    """The policy loss and its per-token gradients, computed together (the fused LM-head chains these).

    Inputs as ``policy_loss``. Returns ``(loss [] fp32, metrics {name: [] fp32}, dloss_dlogp [T] fp32,
    dloss_dentropy [T] fp32)``; the gradients are of the returned (unscaled) loss, zero at masked-out tokens,
    and ``dloss_dentropy`` is ``-entropy_coef·(aggregation weight)`` (zeros when ``entropy`` is None).
    ``loss`` is differentiable w.r.t. ``logp``/``entropy`` like ``policy_loss``'s; the gradients are not.
    """
    check_policy_loss_inputs(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp,
                             entropy=entropy, cu_seqlens=cu_seqlens)
    if torch.compiler.is_compiling():
        loss, metrics, dlogp, dentropy = _policy_loss_op(logp, old_logp, advantages, mask, ref_logp, rollout_logp,
                                                         entropy, cu_seqlens, *(getattr(cfg, f) for f in CONFIG_FIELDS))
    else:
        loss, metrics, dlogp, dentropy = _EagerPolicyLoss.apply(logp, entropy, old_logp, advantages, mask, ref_logp,
                                                                rollout_logp, cu_seqlens, cfg)
    return loss, dict(zip(METRIC_NAMES, metrics.unbind())), dlogp, dentropy


def policy_loss(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None, entropy=None,
                cu_seqlens=None):
    """RL policy loss; the exact math is ``redline.kernels.reference.policy_loss_reference``.

    logp, old_logp, advantages (per token), ref_logp, rollout_logp, entropy: [T] fp32 on one device;
    mask: [T] bool (True = the token is trained on); cu_seqlens: [S+1] int32 sequence boundaries of the
    packed batch (None: the whole batch is one sequence; gspo and the seq-mean aggregations then see S = 1).
    ref_logp is required when cfg.kl_coef != 0, rollout_logp when cfg.tis is set, entropy when
    cfg.entropy_coef != 0; a bad argument raises ValueError naming it.
    Returns ``(loss [] fp32, metrics)``: loss is differentiable w.r.t. logp and entropy; metrics is
    {pg_loss, kl, entropy, clipfrac, approx_kl, tis_mean, tis_clipfrac} of 0-dim fp32 tensors, left on the
    device (no host sync).
    """
    loss, metrics, _, _ = policy_loss_grads(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp,
                                            rollout_logp=rollout_logp, entropy=entropy, cu_seqlens=cu_seqlens)
    return loss, metrics
