"""``fused_linear_policy_loss``: hidden states → RL policy loss, with dHidden and dW produced in the forward call.

Math: ``loss = policy_loss(logp, old_logp, advantages, mask, cfg=cfg, entropy=entropy, ...)`` where
``(logp, entropy) = fused_linear_logprobs(hidden, weight, targets, temperature=...)``; the loss definition is
``redline.kernels.reference.policy_loss_reference`` (``linear_policy_loss_reference`` for the whole chain).
The autograd backward only scales the gradients computed in the call by the upstream scalar, so no
activations are kept. Two execution paths, the same results:

one pass, 6·T·H·V FLOPs — token-level estimators (ppo, cispo; every aggregation). The loss is
  ``Σ_t a_t·x_t`` where the aggregation weights ``a_t`` depend only on mask, cu_seqlens, agg and agg_constant
  (``policy_loss_torch.aggregation_weights``, computed first) and ``x_t`` on token t alone, so
  ``d loss/d logp_t = a_t·dx_t/d logp_t`` is known as soon as the token's logp is. Per token chunk
  (``linear_policy_loss_triton`` / ``_cpu``): fp32 logits of the whole vocabulary into the workspace,
  statistics → logp, entropy; ``dx/d logp`` from the policy-loss implementation itself, run on the chunk with a
  plain-sum aggregation (``seq-mean-token-sum-norm`` with S = 1 and constant 1) and scaled by ``a_t``; then dz
  from the kept logits, dHidden and dW. Afterwards the same implementation computes loss and metrics exactly
  from the full ``[T]`` logp and entropy (cheap).
two passes, 8·T·H·V FLOPs — gspo (whose per-sequence mean of logp − old_logp needs all of a sequence's logp
  before any token's gradient is known), and token-level estimators where it is faster:
  ``linear_logprobs.forward_impl`` (statistics, 2·T·H·V), the policy-loss implementation (loss, metrics,
  per-token gradients), ``linear_logprobs.backward_impl`` (recomputed logits → dz → dHidden, dW; 6·T·H·V).

Which path: ``one_pass=None`` asks the cost model (``lm_head_plan.choose_one_pass``). The one-pass path
read-modify-writes dW once per token chunk and a chunk holds about ``workspace_bytes / (4·V)`` tokens, so it
pays only with a large enough workspace. Measured on an H100 at H=4096, V=151936, T=16384 (bf16): one pass
113.0 ms vs two passes 134.0 ms with the 1 GiB default, 160.5 vs 140.9 ms with 256 MiB (the model, which
charges each chunk a fixed cost, picks two passes there); one pass 106.1 ms after the backward's scale kernel.
Both paths work with tensor parallelism (the one-pass path all-reduces each chunk's statistics: 2 collectives
per chunk; 1 more for dHidden at the end).
"""

import dataclasses
from typing import Optional

import torch

from . import linear_policy_loss_cpu
from .backend import choose, import_triton_module
from .linear_logprobs import (backend_for, backward_impl, check_inputs, forward_impl, gather_rows, scatter_rows,
                              selected_rows, vocab_offset)
from .lm_head_plan import choose_one_pass, one_pass_plan
from .loss_config import LossConfig, check_policy_loss_inputs
from .policy_loss import CONFIG_FIELDS, _config
from .policy_loss import _implementation as policy_loss_implementation
from .policy_loss_torch import aggregation_weights
from .reference import METRIC_NAMES

TOKEN_LEVEL_ESTIMATORS = ("ppo", "cispo")


def _one_pass_backend(device: torch.device):
    if choose(device) == "torch":
        return linear_policy_loss_cpu
    return import_triton_module("linear_policy_loss_triton")


def _plan(cfg: LossConfig, one_pass: Optional[bool], n_rows: int, hidden, weight, gather: bool, budget: int,
          backend):
    """The one-pass ``(token chunk, vocab chunk)``, or None for the two-pass path (``backend``: the logprobs
    implementation module, whose alignment and fused GEMMs the plans follow)."""
    shape = (n_rows, weight.shape[0], weight.shape[1], gather, hidden.element_size(), budget, backend.ALIGN,
             backend.fused_piece(hidden))
    if one_pass is None:
        one_pass = cfg.estimator in TOKEN_LEVEL_ESTIMATORS and choose_one_pass(*shape)
    elif one_pass and cfg.estimator not in TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(f"one_pass=True needs a token-level estimator {TOKEN_LEVEL_ESTIMATORS}; "
                         f"{cfg.estimator!r} needs every token of a sequence before any gradient")
    if not one_pass or n_rows == 0:  # nothing selected: the two-pass path returns zeros without any work
        return None
    plan = one_pass_plan(*shape)
    if plan is None:
        raise ValueError(f"workspace_bytes={budget} cannot hold one token's logits and dz for one_pass=True")
    return plan


def _one_pass_loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp,
                             cu_seqlens, cfg: LossConfig, temperature: float, group, rows, plan):
    loss_fn = policy_loss_implementation(hidden.device)
    # x_t's own gradient: the same implementation with a plain sum over the chunk (S = 1, divisor 1)
    sum_cfg = dataclasses.replace(cfg, agg="seq-mean-token-sum-norm", agg_constant=1.0)
    per_token = []

    def token_grads(t0: int, t1: int, logp, entropy):
        if not per_token:  # made here, once the first chunk's GEMMs are queued: the GPU works while the host does
            per_token.extend(gather_rows(t, rows) for t in (
                aggregation_weights(mask, cu_seqlens, cfg.agg, cfg.agg_constant), old_logp, advantages, ref_logp,
                rollout_logp))
            per_token.append(torch.ones(plan[0], dtype=torch.bool, device=hidden.device))
        agg_weights, old, adv, ref, rollout, everyone = per_token

        def part(t):
            return None if t is None else t[t0:t1]

        _, _, dx, _ = loss_fn(logp, old[t0:t1], adv[t0:t1], everyone[:t1 - t0], cfg=sum_cfg, ref_logp=part(ref),
                              rollout_logp=part(rollout), entropy=entropy, cu_seqlens=None)
        a = agg_weights[t0:t1]
        return dx * a, (-cfg.entropy_coef * a if cfg.entropy_coef != 0 else None)

    logp, entropy, d_hidden, d_weight = _one_pass_backend(hidden.device).one_pass(
        hidden, weight, targets, rows, 1.0 / temperature, vocab_offset(weight, group), plan, token_grads, group)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(d_hidden, group=group)
    n = hidden.shape[0]
    logp, entropy = scatter_rows(logp, rows, n), scatter_rows(entropy, rows, n)
    loss, metrics, _, _ = loss_fn(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp,
                                  rollout_logp=rollout_logp, entropy=entropy, cu_seqlens=cu_seqlens)
    return loss, metrics, d_hidden, d_weight


def _loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens,
                    cfg: LossConfig, temperature: float, group=None, workspace_bytes=None, one_pass=None):
    """(loss [], metrics [len(METRIC_NAMES)], d_hidden, d_weight), all computed now."""
    placeholder = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # logp/entropy to come
    check_policy_loss_inputs(placeholder, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp,
                             rollout_logp=rollout_logp, entropy=placeholder, cu_seqlens=cu_seqlens)
    logprobs_backend = backend_for(hidden.device)
    budget = workspace_bytes or logprobs_backend.POLICY_LOSS_WORKSPACE_BYTES
    rows = selected_rows(mask)
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    plan = _plan(cfg, one_pass, n_rows, hidden, weight, rows is not None, budget, logprobs_backend)
    if plan is not None:
        return _one_pass_loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp,
                                        cu_seqlens, cfg, temperature, group, rows, plan)
    logp, entropy, lse = forward_impl(hidden, weight, targets, mask, temperature, group, budget)
    # The loss implementation directly, not the redline::policy_loss op: a custom op called from inside this
    # one's implementation failed in torch 2.11's dispatcher ("vector::reserve").
    loss, metrics, dlogp, dentropy = policy_loss_implementation(logp.device)(
        logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp, entropy=entropy,
        cu_seqlens=cu_seqlens)
    grad_entropy = dentropy if cfg.entropy_coef != 0 else None
    d_hidden, d_weight = backward_impl(hidden, weight, targets, mask, lse, entropy, dlogp, grad_entropy,
                                       temperature, group, budget)
    return loss, metrics, d_hidden, d_weight


@torch.library.custom_op("redline::linear_policy_loss", mutates_args=())
def _linear_policy_loss_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                           ref_logp: Optional[torch.Tensor], rollout_logp: Optional[torch.Tensor],
                           cu_seqlens: Optional[torch.Tensor], temperature: float, workspace_bytes: Optional[int],
                           one_pass: Optional[bool], estimator: str, eps_clip: float, eps_clip_high: float,
                           eps_clip_c: Optional[float], kl_type: str, kl_coef: float, entropy_coef: float,
                           tis: Optional[str], tis_clip_low: Optional[float], tis_clip: Optional[float], agg: str,
                           agg_constant: Optional[float]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _config(estimator, eps_clip, eps_clip_high, eps_clip_c, kl_type, kl_coef, entropy_coef, tis, tis_clip_low,
                  tis_clip, agg, agg_constant)
    return _loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens,
                           cfg, temperature, None, workspace_bytes, one_pass)


@_linear_policy_loss_op.register_fake
def _(hidden, weight, *args):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(len(METRIC_NAMES), dtype=torch.float32),
            torch.empty_like(hidden), torch.empty_like(weight))


def _setup_context(ctx, inputs, output):
    _, metrics, d_hidden, d_weight = output
    ctx.save_for_backward(d_hidden, d_weight)
    ctx.mark_non_differentiable(metrics, d_hidden, d_weight)
    # No zero-filled upstream gradients for the non-differentiable outputs: for d_hidden and d_weight those would
    # be one more set of gradients (measured on the H100: the backward's peak grew by exactly their size).
    ctx.set_materialize_grads(False)


def _scaled(grad_loss, d_hidden, d_weight):
    """The saved gradients times the upstream scalar, in place (they are used once, and a copy would double the
    gradient memory); on the Triton path a scale of exactly 1 costs no memory traffic and no host sync."""
    if choose(d_hidden.device) == "torch":
        return d_hidden.mul_(grad_loss), d_weight.mul_(grad_loss)
    scale_ = import_triton_module("scale_triton").scale_
    return scale_(d_hidden, grad_loss), scale_(d_weight, grad_loss)


def _backward(ctx, grad_loss, _grad_metrics, _grad_dh, _grad_dw):
    # the loss is the op's one differentiable output, so grad_loss is always given even without materialising
    return _scaled(grad_loss, *ctx.saved_tensors) + (None,) * (len(CONFIG_FIELDS) + 10)


_linear_policy_loss_op.register_autograd(_backward, setup_context=_setup_context)


class _LinearPolicyLossTP(torch.autograd.Function):
    """Vocab-parallel variant: collectives inside, so it runs eagerly (no custom-op registration)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp, cu_seqlens, cfg,
                temperature, group, workspace_bytes, one_pass):
        loss, metrics, d_hidden, d_weight = _loss_and_grads(hidden, weight, targets, old_logp, advantages, mask,
                                                            ref_logp, rollout_logp, cu_seqlens, cfg, temperature,
                                                            group, workspace_bytes, one_pass)
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        return _scaled(grad_loss, *ctx.saved_tensors) + (None,) * 12


@torch.compiler.disable
def _linear_policy_loss_tp(*args):
    return _LinearPolicyLossTP.apply(*args)


def fused_linear_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                             cfg: LossConfig, temperature: float = 1.0, ref_logp: Optional[torch.Tensor] = None,
                             rollout_logp: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                             tp_group=None, workspace_bytes: Optional[int] = None,
                             one_pass: Optional[bool] = None) -> tuple[torch.Tensor, dict]:
    """RL policy loss straight from the LM head's input: ``(loss [] fp32, metrics {name: [] fp32})``.

    hidden ``[T, H]``, weight ``[V, H]`` (with ``tp_group``: this rank's vocab shard, targets global ids),
    targets ``[T]`` int64, mask ``[T]`` bool; old_logp, advantages, ref_logp, rollout_logp ``[T]`` fp32;
    cu_seqlens ``[S+1]`` int32 — as ``policy_loss``. The entropy used for ``cfg.entropy_coef`` and the
    ``entropy`` metric is that of the temperature-scaled distribution. The loss is differentiable w.r.t.
    hidden and weight; their gradients are computed during this call (see the module docstring), so a
    backward of ``c·loss`` costs only a scale.

    ``workspace_bytes``: the logits workspace, the memory this call uses beyond its inputs, the ``[T]``
    statistics and the two gradients (None: 1 GiB for CUDA tensors, 32 MiB on the CPU path). ``one_pass``:
    None lets the cost model pick the path; True forces the one-pass path (ppo/cispo only; ValueError for gspo
    or a workspace too small for one token's logits), False the two-pass path.
    """
    check_inputs(hidden, weight, targets, mask, temperature)
    if not isinstance(cfg, LossConfig):
        raise ValueError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if mask is None:
        raise ValueError("mask is required ([T] bool, True = the token is trained on)")
    if workspace_bytes is not None and (isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int)
                                        or workspace_bytes <= 0):
        raise ValueError(f"workspace_bytes must be a positive int (bytes) or None, got {workspace_bytes!r}")
    if one_pass not in (None, True, False):
        raise ValueError(f"one_pass must be None, True or False, got {one_pass!r}")
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    if tp_group is not None:
        loss, metrics = _linear_policy_loss_tp(hidden, weight, targets, old_logp, advantages, mask, ref_logp,
                                               rollout_logp, cu_seqlens, cfg, float(temperature), tp_group,
                                               workspace_bytes, one_pass)
        return loss, dict(zip(METRIC_NAMES, metrics.unbind()))
    loss, metrics, _, _ = _linear_policy_loss_op(hidden, weight, targets, old_logp, advantages, mask, ref_logp,
                                                 rollout_logp, cu_seqlens, float(temperature), workspace_bytes,
                                                 one_pass, *(getattr(cfg, f) for f in CONFIG_FIELDS))
    return loss, dict(zip(METRIC_NAMES, metrics.unbind()))
