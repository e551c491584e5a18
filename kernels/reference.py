"""Plain-PyTorch definitions the kernels are tested against. Written for clarity, not speed.

They run in the dtype of their inputs (pass fp64 for a high-precision reference) and get their gradients from
autograd. Each one states the exact math; the kernels' docstrings point here.
"""

import torch

from redline.kernels.loss_config import LossConfig, check_policy_loss_inputs

METRIC_NAMES = ("pg_loss", "kl", "entropy", "clipfrac", "approx_kl", "tis_mean", "tis_clipfrac")


def sequence_index(cu_seqlens: torch.Tensor | None, num_tokens: int, device) -> tuple[torch.Tensor, int]:
    """``(seq [T] int64, S)``: the sequence each token belongs to; ``cu_seqlens=None`` means one sequence."""
    if cu_seqlens is None:
        return torch.zeros(num_tokens, dtype=torch.long, device=device), 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    num_seqs = lengths.numel()
    return torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths, output_size=num_tokens), num_seqs


def kl_estimate(delta: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Sampled-token KL estimate from ``delta = logp - ref_logp`` (slime's k1/k2/k3/low_var_kl)."""
    if kl_type == "k1":
        return delta
    if kl_type == "k2":
        return delta.square() / 2
    k3 = torch.expm1(-delta) + delta  # = exp(-delta) - 1 + delta, without fp32 cancellation near 0
    return k3.clamp(-10, 10) if kl_type == "low_var_kl" else k3


def policy_loss_reference(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                          entropy=None, cu_seqlens=None):
    """The RL policy loss, by its definition. Same signature and contract as ``redline.kernels.policy_loss``.

    Per token t of sequence i (masked-out tokens contribute nothing):
      ratio        r_t = exp(logp_t - old_logp_t); gspo: r_t = exp(s_i), s_i = mean over the masked tokens of
                   sequence i of (logp - old_logp)
      ppo / gspo   pg_t = max(-r·A, -clip(r, 1-eps_clip, 1+eps_clip_high)·A); dual clip (eps_clip_c) where A < 0:
                   pg_t = min(pg_t, -eps_clip_c·A)
      cispo        pg_t = -stopgrad(clip(r, 1-eps_clip, 1+eps_clip_high))·A·logp_t
      tis          w = exp(old_logp - rollout_logp) (no gradient); truncate: pg_t *= clamp(w, low, high);
                   icepop: pg_t *= w if low <= w <= high else 0
      kl           kl_estimate(logp - ref_logp, kl_type) (zero without ref_logp)
      total        x_t = pg_t + kl_coef·kl_t - entropy_coef·entropy_t
    The loss is ``aggregate(x)`` over the S sequences of ``cu_seqlens``, n_i masked tokens in sequence i:
      token-mean               Σ_i Σ_t x_t / max(Σ_i n_i, 1)
      seq-mean-token-mean      Σ_i (Σ_t x_t / max(n_i, 1)) / S
      seq-mean-token-sum       Σ_i Σ_t x_t / S
      seq-mean-token-sum-norm  Σ_i Σ_t x_t / (S · agg_constant)
    S counts every sequence, also one whose mask is empty (it adds 0 to the sum and 1 to S): a sample removed
    from training by masking all its tokens still counts, as slime, TRL and verl's engine count it.
    Metrics pg_loss/kl/entropy use the same aggregation, the rest are token-means.
    ``clipfrac`` counts tokens whose loss came from a clipped branch (ratio clip or dual clip; cispo: the ratio
    lies outside its bounds), ``tis_mean`` is the token-mean of the applied weight (1 without tis) and
    ``tis_clipfrac`` the token-mean of ``w`` falling outside [tis_clip_low, tis_clip].
    Returns ``(loss, metrics)``, 0-dim tensors in the inputs' dtype; metrics are detached.
    """
    check_policy_loss_inputs(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp,
                             rollout_logp=rollout_logp, entropy=entropy, cu_seqlens=cu_seqlens,
                             float_dtypes=(torch.float32, torch.float64))
    seq, num_seqs = sequence_index(cu_seqlens, logp.shape[0], logp.device)
    weights = mask.to(logp.dtype)
    tokens_per_seq = torch.zeros(num_seqs, dtype=logp.dtype, device=logp.device).index_add(0, seq, weights)

    def masked(x):  # where, not multiply: values at masked-out positions may overflow (inf * 0 = nan)
        return torch.where(mask, x, torch.zeros_like(x))

    def token_mean(x):
        return masked(x.to(logp.dtype)).sum() / weights.sum().clamp(min=1)

    def aggregate(x):
        per_seq = torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq, masked(x))
        if cfg.agg == "token-mean":
            return per_seq.sum() / weights.sum().clamp(min=1)
        if cfg.agg == "seq-mean-token-mean":
            return (per_seq / tokens_per_seq.clamp(min=1)).sum() / num_seqs
        if cfg.agg == "seq-mean-token-sum":
            return per_seq.sum() / num_seqs
        return per_seq.sum() / (num_seqs * cfg.agg_constant)

    log_ratio = masked(logp - old_logp)
    if cfg.estimator == "gspo":
        seq_mean = torch.zeros_like(tokens_per_seq).index_add(0, seq, log_ratio) / tokens_per_seq.clamp(min=1)
        log_ratio = seq_mean[seq]
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    if cfg.estimator == "cispo":
        pg = -clipped_ratio.detach() * advantages * logp
        clipped = clipped_ratio != ratio
    else:
        unclipped_loss, clipped_loss = -ratio * advantages, -clipped_ratio * advantages
        pg = torch.maximum(unclipped_loss, clipped_loss)
        clipped = clipped_loss > unclipped_loss
        if cfg.eps_clip_c is not None:
            dual_loss = -cfg.eps_clip_c * advantages
            dual = (advantages < 0) & (dual_loss < pg)
            pg = torch.where(advantages < 0, torch.minimum(pg, dual_loss), pg)
            clipped = clipped | dual
    if cfg.tis is None:
        tis_weight, tis_outside = torch.ones_like(logp), torch.zeros_like(mask)
    else:
        w = torch.exp(masked(old_logp - rollout_logp)).detach()
        tis_outside = (w < cfg.tis_clip_low) | (w > cfg.tis_clip)
        if cfg.tis == "truncate":
            tis_weight = w.clamp(cfg.tis_clip_low, cfg.tis_clip)
        else:
            tis_weight = torch.where(tis_outside, torch.zeros_like(w), w)
        pg = pg * tis_weight
    kl = kl_estimate(masked(logp - ref_logp), cfg.kl_type) if ref_logp is not None else torch.zeros_like(logp)
    ent = entropy if entropy is not None else torch.zeros_like(logp)
    loss = aggregate(pg + cfg.kl_coef * kl - cfg.entropy_coef * ent)
    values = (aggregate(pg), aggregate(kl), aggregate(ent), token_mean(clipped), token_mean(old_logp - logp),
              token_mean(tis_weight), token_mean(tis_outside))
    return loss, {name: value.detach() for name, value in zip(METRIC_NAMES, values)}


def linear_logprobs_reference(hidden, weight, targets, *, temperature=1.0, mask=None, return_entropy=False):
    """Per-token log-probs (and entropy) of ``targets`` under ``softmax(hidden @ weight.T / temperature)``.

    hidden: [T, H], weight: [V, H], targets: [T] int64, mask: [T] bool or None. The logits are computed in
    fp32, or fp64 when the inputs are fp64 (never in bf16). ``logp_t = z_y - logsumexp(z)``,
    ``entropy_t = logsumexp(z) - Σ_v softmax(z)_v z_v`` with ``z = logits / temperature``. Masked-out tokens
    give 0 (and so zero gradient); their targets are not read. Returns ``logp [T]`` or ``(logp, entropy)``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [T, H] and weight [V, H] must share H, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 of shape [{hidden.shape[0]}], got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if mask is not None and (mask.shape != targets.shape or mask.dtype != torch.bool):
        raise ValueError(f"mask must be bool of shape [{hidden.shape[0]}], got {mask.dtype} {tuple(mask.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature
    if mask is not None:
        targets = torch.where(mask, targets, torch.zeros_like(targets))
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    if mask is not None:
        logp = torch.where(mask, logp, torch.zeros_like(logp))
        entropy = torch.where(mask, entropy, torch.zeros_like(entropy))
    return (logp, entropy) if return_entropy else logp


def linear_policy_loss_reference(hidden, weight, targets, old_logp, advantages, mask, *, cfg: LossConfig,
                                 temperature=1.0, ref_logp=None, rollout_logp=None, cu_seqlens=None):
    """``linear_logprobs_reference`` (with entropy) followed by ``policy_loss_reference``: the whole RL loss
    from hidden states. Returns ``(loss, metrics)``; the entropy metric is always filled in."""
    logp, entropy = linear_logprobs_reference(hidden, weight, targets, temperature=temperature, mask=mask,
                                              return_entropy=True)
    return policy_loss_reference(logp, old_logp.to(logp.dtype), advantages.to(logp.dtype), mask, cfg=cfg,
                                 ref_logp=None if ref_logp is None else ref_logp.to(logp.dtype),
                                 rollout_logp=None if rollout_logp is None else rollout_logp.to(logp.dtype),
                                 entropy=entropy, cu_seqlens=cu_seqlens)
