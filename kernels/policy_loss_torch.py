"""The PyTorch path of the policy loss: the Triton kernels' math, gradients derived by hand, vectorised.

Used for CPU tensors. The gradients are written out rather than taken from autograd because autograd does
not record inside a ``torch.library`` custom op, which is where this runs. The math is
``redline.kernels.reference.policy_loss_reference``; the tests hold both to it.
"""

import torch

from redline.kernels.loss_config import LossConfig
from redline.kernels.reference import kl_estimate, sequence_index


def _per_seq(x, seq, num_seqs):
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, x)


def _aggregation_weights(mask, seq, num_seqs: int, agg: str, agg_constant, dtype) -> torch.Tensor:
    weights = mask.to(dtype)
    if agg == "token-mean":
        scale = (1 / weights.sum().clamp(min=1)).expand(num_seqs)
    elif agg == "seq-mean-token-mean":  # S counts empty sequences too (reference.policy_loss_reference)
        scale = 1 / (num_seqs * _per_seq(weights, seq, num_seqs).clamp(min=1))
    elif agg == "seq-mean-token-sum":
        scale = torch.full((num_seqs,), 1 / num_seqs, dtype=dtype, device=mask.device)
    else:
        scale = torch.full((num_seqs,), 1 / (num_seqs * agg_constant), dtype=dtype, device=mask.device)
    return torch.where(mask, scale.to(dtype)[seq], torch.zeros((), dtype=dtype, device=mask.device))


def aggregation_weights(mask, cu_seqlens, agg: str, agg_constant=None, dtype=torch.float32) -> torch.Tensor:
    """``[T]``: d loss / d x_t of the aggregation ``agg`` (``LossConfig.agg``) — 0 at masked-out tokens.

    The loss is ``Σ_t weight_t · x_t``; the weights depend on mask, cu_seqlens, agg and agg_constant only (no
    host sync), so a caller can scale token-local gradients before any token's loss is known.
    """
    seq, num_seqs = sequence_index(cu_seqlens, mask.shape[0], mask.device)
    return _aggregation_weights(mask, seq, num_seqs, agg, agg_constant, dtype)


def policy_loss_grads_torch(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                            entropy=None, cu_seqlens=None):
    """``policy_loss_grads`` on already-checked inputs, in PyTorch. Returns ``(loss [], metrics [7] in
    METRIC_NAMES order, dloss_dlogp [T], dloss_dentropy [T])``, fp32 like the inputs."""
    seq, num_seqs = sequence_index(cu_seqlens, logp.shape[0], logp.device)
    zeros = torch.zeros_like(logp)
    weights = mask.to(logp.dtype)
    old_logp, advantages = torch.where(mask, old_logp, zeros), torch.where(mask, advantages, zeros)
    logp = torch.where(mask, logp, zeros)  # masked-out tokens read as 0, as in the kernel: nothing can overflow

    def per_seq(x):
        return _per_seq(x, seq, num_seqs)

    tokens_per_seq = per_seq(weights)
    token_scale = 1 / weights.sum().clamp(min=1)
    scale = _aggregation_weights(mask, seq, num_seqs, cfg.agg, cfg.agg_constant, logp.dtype)  # d loss / d x_t
    if cfg.tis is None:
        tis_weight, tis_outside = weights, torch.zeros_like(mask)
    else:
        w = torch.exp(old_logp - torch.where(mask, rollout_logp, zeros))
        tis_outside = mask & ((w < cfg.tis_clip_low) | (w > cfg.tis_clip))
        if cfg.tis == "truncate":
            tis_weight = w.clamp(cfg.tis_clip_low, cfg.tis_clip)
        else:
            tis_weight = torch.where(tis_outside, zeros, w)
    if cfg.estimator == "gspo":
        seq_ratio = torch.exp(per_seq(logp - old_logp) / tokens_per_seq.clamp(min=1))
        ratio = seq_ratio[seq]
    else:
        ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    if cfg.estimator == "cispo":
        pg, clipped, dpg = -clipped_ratio * advantages * logp, clipped_ratio != ratio, -clipped_ratio * advantages
    else:
        unclipped_loss, clipped_loss = -ratio * advantages, -clipped_ratio * advantages
        pg, clipped = torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss
        if cfg.eps_clip_c is not None:
            dual_loss = -cfg.eps_clip_c * advantages
            dual = (advantages < 0) & (dual_loss < pg)
            pg, clipped = torch.where(dual, dual_loss, pg), clipped | dual
        dpg = torch.where(clipped, zeros, unclipped_loss)  # d pg / d log-ratio: -A·r where not clipped
    pg, dpg = pg * tis_weight, dpg * tis_weight
    if cfg.estimator == "gspo":  # every masked token's log-ratio moves its sequence's mean by 1/n
        dpg = (per_seq(dpg) / tokens_per_seq.clamp(min=1))[seq]
    x, dx, kl = pg, dpg, zeros
    if ref_logp is not None:
        delta = logp - torch.where(mask, ref_logp, zeros)
        kl = kl_estimate(delta, cfg.kl_type)
        if cfg.kl_type == "k1":
            dkl = torch.ones_like(delta)
        elif cfg.kl_type == "k2":
            dkl = delta
        else:
            dkl = -torch.expm1(-delta)
            if cfg.kl_type == "low_var_kl":  # zero where the clamp to [-10, 10] is active
                dkl = torch.where(kl_estimate(delta, "k3").abs() <= 10, dkl, zeros)
        x, dx = x + cfg.kl_coef * kl, dx + cfg.kl_coef * dkl
    ent = torch.where(mask, entropy, zeros) if entropy is not None else zeros
    x = x - cfg.entropy_coef * ent
    token_means = torch.stack([clipped.to(logp.dtype), old_logp - logp, tis_weight, tis_outside.to(logp.dtype)])
    sums = torch.cat([torch.stack([x, pg, kl, ent]) @ scale, torch.where(mask, token_means, 0).sum(1) * token_scale])
    return sums[0].clone(), sums[1:].clone(), scale * dx, -cfg.entropy_coef * scale  # outputs may not alias
