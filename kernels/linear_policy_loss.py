"""``fused_linear_policy_loss``: hidden states → RL policy loss, with dHidden and dW produced in the forward call.

Math: ``loss = policy_loss(logp, old_logp, advantages, mask, cfg=cfg, entropy=entropy, ...)`` where
``(logp, entropy) = fused_linear_logprobs(hidden, weight, targets, temperature=...)``; the loss definition is
``redline.kernels.reference.policy_loss_reference`` (``linear_policy_loss_reference`` for the whole chain).
The autograd backward only scales the gradients computed in the call by the upstream scalar, so no
activations are kept. Two execution paths, the same results:

one pass, 6·T·H·V FLOPs — every estimator and aggregation (gspo when each sequence fits in a token chunk). The
  loss is ``Σ_t a_t·x_t`` where the aggregation weights ``a_t`` depend only on mask, cu_seqlens, agg and
  agg_constant (``policy_loss_torch.aggregation_weights``, computed first) and are equal over a sequence's
  selected tokens; ``x_t`` depends on token t alone (ppo, cispo) or on its sequence (gspo: the sequence's mean of
  logp − old_logp). Per token chunk (``linear_policy_loss_triton`` / ``_cpu``): fp32 logits of the whole vocabulary
  into the workspace, statistics → logp, entropy; then the chunk's ``d loss/d logp``: the policy-loss
  implementation itself, run on the chunk's S_c sequences with ``seq-mean-token-sum`` (weight 1/S_c), times
  ``a_t·S_c`` — exact as each ``x_u`` that token t moves lies in t's sequence, whose weight is ``a_t``. The
  chunks (``lm_head_plan.token_chunk_bounds``) are cut every ``token chunk`` selected rows for ppo and cispo and
  on sequence boundaries for gspo (as many whole sequences as fit; selected rows ascend, so a sequence's selected
  tokens are contiguous among them). Then dz from the kept logits, dHidden and dW. Afterwards the same
  implementation computes loss and metrics exactly from the full ``[T]`` logp and entropy (cheap).
two passes, 8·T·H·V FLOPs — wherever they are faster, and gspo when a sequence has more selected tokens than a
  token chunk holds: ``linear_logprobs.forward_impl`` (statistics, 2·T·H·V), the policy-loss implementation
  (loss, metrics, per-token gradients), ``linear_logprobs.backward_impl`` (recomputed logits → dz → dHidden, dW;
  6·T·H·V).

Which path: ``one_pass=None`` asks the cost model (``lm_head_plan.choose_one_pass``). The one-pass path
read-modify-writes dW once per token chunk and a chunk holds about ``workspace_bytes / (4·V)`` tokens, so it
pays only with a large enough workspace; for gspo the model counts the sequence-aligned chunks (at least
⌈R / token chunk⌉, closer to it the shorter the sequences) and rules the path out when a sequence exceeds a chunk.
Measured on an H100 at H=4096, V=151936, T=16384 (bf16): one pass 113.0 ms vs two passes 134.0 ms with the 1 GiB
default, 160.5 vs 140.9 ms with 256 MiB (the model, which charges each chunk a fixed cost, picks two passes there);
one pass 106.1 ms after the backward's scale kernel.
Both paths work with tensor parallelism (the one-pass path all-reduces each chunk's statistics: 2 collectives
per chunk; 1 more for dHidden at the end).
"""

import bisect
import dataclasses
from typing import Optional

import torch

from . import linear_policy_loss_cpu
from .backend import choose, import_triton_module
from .linear_logprobs import (backend_for, backward_impl, check_inputs, forward_impl, gather_rows, scatter_rows,
                              selected_rows, vocab_offset)
from .lm_head_plan import choose_one_pass, max_chunk, one_pass_plan, one_pass_token_capacity, token_chunk_bounds
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


def _sequence_bounds(mask, cu_seqlens, n_rows: int) -> list[int]:
    """``[S+1]`` host ints: sequence i's selected tokens are the selected rows ``b[i]`` … ``b[i+1] − 1`` (one host
    sync). The selected rows ascend and a sequence's tokens are contiguous, so its selected tokens are contiguous
    among the selected rows; without ``cu_seqlens`` the batch is one sequence."""
    if cu_seqlens is None:
        return [0, n_rows]
    selected_before = torch.nn.functional.pad(mask.cumsum(0), (1, 0))  # [T+1]: selected rows before each token
    return selected_before[cu_seqlens.long()].tolist()


def _plan(cfg: LossConfig, one_pass: Optional[bool], n_rows: int, hidden, weight, gather: bool, budget: int,
          backend, seq_bounds):
    """The one-pass ``(token chunk boundaries, vocab chunk)``, or None for the two-pass path (``backend``: the
    logprobs implementation module, whose alignment and fused GEMMs the plans follow). ``seq_bounds``: for gspo
    the sequences' boundaries among the selected rows (``_sequence_bounds``): each chunk holds whole sequences."""
    shape = (n_rows, weight.shape[0], weight.shape[1], gather, hidden.element_size(), budget, backend.ALIGN,
             backend.fused_piece(hidden, weight.shape[0]))
    if one_pass is None:
        one_pass = choose_one_pass(*shape, seq_bounds)
    if not one_pass or n_rows == 0:  # nothing selected: the two-pass path returns zeros without any work
        return None
    plan = one_pass_plan(*shape, seq_bounds)
    if plan is None:
        capacity = one_pass_token_capacity(*shape)
        if capacity == 0:
            raise ValueError(f"workspace_bytes={budget} cannot hold one token's logits and dz for one_pass=True")
        raise ValueError(f"one_pass=True with estimator {cfg.estimator!r} needs each sequence's selected tokens in "
                         f"one token chunk, but the longest sequence has {max_chunk(seq_bounds)} and a chunk holds "
                         f"at most {capacity} within workspace_bytes={budget}; raise workspace_bytes, or pass "
                         f"one_pass=None to fall back to two passes")
    return token_chunk_bounds(n_rows, plan[0], seq_bounds), plan[1]


def _one_pass_loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp,
                             cu_seqlens, cfg: LossConfig, temperature: float, group, rows, chunks, vocab_chunk,
                             seq_bounds):
    loss_fn = policy_loss_implementation(hidden.device)
    # A chunk's gradients: the same implementation on the chunk alone (its sequences, whole, with seq_bounds) with
    # weight 1/S_c on each of its S_c sequences' tokens. Every aggregation weights all selected tokens of a
    # sequence alike (a_t = a_u), so d loss/d logp_t = Σ_u a_u·dx_u/d logp_t = a_t·S_c·(the chunk's gradient).
    chunk_cfg = dataclasses.replace(cfg, agg="seq-mean-token-sum", agg_constant=None)
    per_token = []

    def token_grads(t0: int, t1: int, logp, entropy):
        if not per_token:  # made here, once the first chunk's GEMMs are queued: the GPU works while the host does
            per_token.extend(gather_rows(t, rows) for t in (
                aggregation_weights(mask, cu_seqlens, cfg.agg, cfg.agg_constant), old_logp, advantages, ref_logp,
                rollout_logp))
            per_token.append(torch.ones(max_chunk(chunks), dtype=torch.bool, device=hidden.device))
            per_token.append(None if seq_bounds is None else
                             torch.tensor(seq_bounds, dtype=torch.int32, device=hidden.device))
        agg_weights, old, adv, ref, rollout, everyone, bounds = per_token

        def part(t):
            return None if t is None else t[t0:t1]

        chunk_cu, num_seqs = None, 1
        if seq_bounds is not None:  # the chunk's sequences, from its first boundary t0 to its last t1
            first, end = bisect.bisect_left(seq_bounds, t0), bisect.bisect_right(seq_bounds, t1)
            chunk_cu, num_seqs = bounds[first:end] - t0, end - first - 1
        _, _, dx, _ = loss_fn(logp, old[t0:t1], adv[t0:t1], everyone[:t1 - t0], cfg=chunk_cfg, ref_logp=part(ref),
                              rollout_logp=part(rollout), entropy=entropy, cu_seqlens=chunk_cu)
        a = agg_weights[t0:t1]
        scale = a if num_seqs == 1 else a * num_seqs  # the chunk's loss weighted its sequences 1/S_c
        return dx * scale, (-cfg.entropy_coef * a if cfg.entropy_coef != 0 else None)

    logp, entropy, d_hidden, d_weight = _one_pass_backend(hidden.device).one_pass(
        hidden, weight, targets, rows, 1.0 / temperature, vocab_offset(weight, group), chunks, vocab_chunk,
        token_grads, group)
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
    seq_bounds = None  # gspo: each one-pass chunk holds whole sequences
    if cfg.estimator not in TOKEN_LEVEL_ESTIMATORS and one_pass is not False:
        seq_bounds = _sequence_bounds(mask, cu_seqlens, n_rows)
    plan = _plan(cfg, one_pass, n_rows, hidden, weight, rows is not None, budget, logprobs_backend, seq_bounds)
    if plan is not None:
        return _one_pass_loss_and_grads(hidden, weight, targets, old_logp, advantages, mask, ref_logp, rollout_logp,
                                        cu_seqlens, cfg, temperature, group, rows, *plan, seq_bounds)
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
    None lets the cost model pick the path; True forces the one-pass path (ValueError for a workspace too small
    for one token's logits, or with gspo for a sequence with more selected tokens than a token chunk holds),
    False the two-pass path.
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
