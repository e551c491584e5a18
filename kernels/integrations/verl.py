"""verl on redline's kernels: a registered policy loss and a fused-head backend for the FSDP actor's log-probs.

``register()`` (verl is imported then, not before) adds
* policy loss ``"redline"`` to verl's registry (``core_algos.register_policy_loss``):
  ``actor_rollout_ref.actor.policy_loss.loss_mode=redline`` computes verl's vanilla PPO policy term with
  ``redline.kernels.policy_loss``;
* fused-kernel backend ``"redline"`` to ``monkey_patch.patch_forward_with_backends``:
  ``actor_rollout_ref.model.use_fused_kernels=True`` with ``...model.fused_kernel_options.impl_backend=redline``
  makes the actor's forward return ``log_probs`` / ``entropy`` from the last hidden state through
  ``fused_linear_logprobs`` (no ``[T, V]`` logits).
verl's workers import it through ``actor_rollout_ref.model.external_lib=redline.kernels.integrations.verl_plugin``
(a module whose import calls ``register()``). Tested with verl 0.9.1 (kernels/README.md, "With verl").

How verl's actor options become a ``LossConfig`` (``loss_config_from_verl``):
  clip_ratio_low / clip_ratio_high (default clip_ratio)  eps_clip / eps_clip_high
  clip_ratio_c                                           eps_clip_c (verl always applies its dual clip)
  loss_agg_mode  token-mean / seq-mean-token-mean / seq-mean-token-sum / seq-mean-token-sum-norm (agg_constant
                 loss_scale_factor, else the response length) / token-sum, rescaled to verl's global
                 normalisers (dp_size, batch_num_tokens, global_batch_size); sequences with no response token
                 are left out of the seq-mean count, as verl leaves them out
  kl_loss_type   k1/kl -> k1, k2/mse -> k2, k3/low_var_kl -> low_var_kl (verl's k3 is clamped to [-10, 10]);
                 kl_coef = kl_loss_coef when use_kl_loss; entropy_coef = entropy_coeff
  rollout_is_weights   verl's precomputed rollout-correction weights multiply the policy term, as tis="truncate"
                       on rollout_logp = old - log(weight)
Refused with a ValueError naming the option: kl_loss_type abs / full / the straight-through "+" variants, an
unknown loss_agg_mode. One difference stays: verl clamps the log-ratio to [-20, 20] before exp, redline does not
(it changes only tokens whose probability moved by more than e^20).
The registered loss computes the policy term alone (kl_coef = entropy_coef = 0): verl's own actor loss adds
its KL and entropy terms after it. ``loss_config_from_verl`` with its defaults gives the whole actor loss in one
``fused_linear_policy_loss`` call.
"""

import dataclasses

import torch

from ..linear_logprobs import fused_linear_logprobs
from ..loss_config import LossConfig
from ..policy_loss import policy_loss
from .common import WEIGHT_TIS, fusable_lm_head_weight, rollout_logp_for_weights

KL_TYPES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "low_var_kl", "low_var_kl": "low_var_kl"}
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
BACKEND = "redline"


def _option(config, name, default=None):
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def loss_config_from_verl(config, *, loss_agg_mode: str | None = None, response_length: int | None = None,
                          kl: bool = True, entropy: bool = True) -> LossConfig:
    """The ``LossConfig`` of a verl ``ActorConfig`` (or its DictConfig): module docstring. ``response_length``:
    the batch's padded response length, verl's divisor for ``seq-mean-token-sum-norm`` without
    ``loss_scale_factor``. ``loss_agg_mode``: overrides the config's. ``kl`` / ``entropy``: include verl's KL
    and entropy terms."""
    clip_ratio = _option(config, "clip_ratio", 0.2)
    low, high = _option(config, "clip_ratio_low"), _option(config, "clip_ratio_high")
    mode = loss_agg_mode or _option(config, "loss_agg_mode", "token-mean")
    if mode not in AGG_MODES:
        raise ValueError(f"actor loss_agg_mode={mode!r} has no redline equivalent; supported: {AGG_MODES}")
    fields = {"estimator": "ppo", "eps_clip": clip_ratio if low is None else low,
              "eps_clip_high": clip_ratio if high is None else high, "eps_clip_c": _option(config, "clip_ratio_c", 3.0)}
    if mode == "seq-mean-token-sum-norm":
        factor = _option(config, "loss_scale_factor") or response_length
        if factor is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor or the response length")
        fields.update(agg="seq-mean-token-sum-norm", agg_constant=float(factor))
    elif mode == "token-sum":  # Σ x = S · (Σ x / S): the per-batch factor S is applied by the caller
        fields.update(agg="seq-mean-token-sum-norm", agg_constant=1.0)
    else:
        fields["agg"] = mode
    if kl and _option(config, "use_kl_loss", False):
        kl_type = _option(config, "kl_loss_type", "low_var_kl")
        if kl_type not in KL_TYPES:
            raise ValueError(f"actor kl_loss_type={kl_type!r} has no redline equivalent; supported: {tuple(KL_TYPES)}")
        fields.update(kl_type=KL_TYPES[kl_type], kl_coef=_option(config, "kl_loss_coef", 0.001))
    if entropy:
        fields["entropy_coef"] = _option(config, "entropy_coeff", 0.0)
    return LossConfig(**fields)


def aggregation_scale(mode: str, mask: torch.Tensor, global_batch_info: dict):
    """``(rows, scale)`` for a ``[B, T]`` response mask: the batch rows redline aggregates over (None: all) and
    the factor from redline's normalised aggregation to verl's ``agg_loss`` with ``global_batch_info``."""
    dp_size = global_batch_info.get("dp_size", 1) or 1

    def global_count(key: str, local):
        """verl's global count ``key``, or this rank's own when it runs alone."""
        value = global_batch_info.get(key)
        if value is None and dp_size > 1:
            raise ValueError(f"{key} is required when dp_size > 1")
        return local if value is None else value

    if mode == "token-mean":
        tokens = mask.sum()
        return None, tokens.clamp(min=1) / global_count("batch_num_tokens", tokens) * dp_size
    if mode == "token-sum":
        return None, mask.shape[0] * dp_size
    rows = mask.any(dim=-1)
    sequences = rows.sum()
    global_sequences = global_count("global_batch_size", sequences)
    if sequences == 0:  # nothing to train on: every term is 0
        return None, 0.0
    return rows, sequences / global_sequences * dp_size


def compute_policy_loss_redline(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """verl's ``PolicyLossFn`` (``[B, T]`` tensors in, ``(pg_loss [], metrics)`` out) through redline's policy
    loss: verl's vanilla PPO policy term with its dual clip, aggregation and rollout-correction weights."""
    if config is None:
        raise ValueError("policy loss 'redline' needs the actor config (clip_ratio_*, loss_agg_mode)")
    length = log_prob.shape[1]
    info = _option(config, "global_batch_info", None) or {}
    cfg = loss_config_from_verl(config, loss_agg_mode=loss_agg_mode, response_length=length, kl=False, entropy=False)
    if cfg.agg_constant is not None and loss_agg_mode != "token-sum":  # agg_loss reads the factor from the batch info
        cfg = dataclasses.replace(cfg, agg_constant=float(info.get("loss_scale_factor") or length))
    rows, scale = aggregation_scale(loss_agg_mode, response_mask.bool(), info)
    tensors = [log_prob, old_log_prob, advantages, response_mask.bool()]
    if rollout_is_weights is not None:
        cfg = dataclasses.replace(cfg, **WEIGHT_TIS)
        tensors.append(rollout_logp_for_weights(old_log_prob, rollout_is_weights))
    if rows is not None:
        tensors = [t[rows] for t in tensors]
    logp, old, adv, mask, *rollout = [t.reshape(-1).contiguous() for t in tensors]
    logp, old, adv = logp.float(), old.float(), adv.float()
    per_seq = logp.shape[0] // length
    cu_seqlens = torch.arange(0, per_seq * length + 1, length, dtype=torch.int32, device=logp.device)
    loss, metrics = policy_loss(logp, old, adv, mask, cfg=cfg, rollout_logp=rollout[0].float() if rollout else None,
                                cu_seqlens=cu_seqlens)
    return loss * scale, {"actor/pg_clipfrac": metrics["clipfrac"].item(),
                          "actor/ppo_kl": metrics["approx_kl"].item()}


def forward_with_redline_backend(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                                 inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                                 output_hidden_states=None, return_dict=None, cache_position=None, logits_to_keep=0,
                                 temperature: float = 1.0, shift_labels=None, **loss_kwargs):
    """verl's fused-kernel forward contract (``dense_common.forward_with_torch_backend``): log-prob and entropy
    ``[B, L]`` fp32 of the rolled labels, from the decoder's last hidden state through ``fused_linear_logprobs``."""
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    if not return_dict:
        raise NotImplementedError("the redline fused-kernel backend returns a dict (verl passes return_dict=True)")
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                         cache_position=cache_position)
    hidden = outputs[0]
    if shift_labels is not None:
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    else:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    weight = fusable_lm_head_weight(self)
    rows = hidden.reshape(-1, hidden.shape[-1])
    log_probs, entropy = fused_linear_logprobs(rows, weight.to(rows.dtype), rolled.reshape(-1).long(),
                                               temperature=float(temperature), return_entropy=True)
    return CausalLMOutputForPPO(log_probs=log_probs.view(rolled.shape), entropy=entropy.view(rolled.shape),
                                past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                                attentions=outputs.attentions)


def register() -> None:
    """Add policy loss ``"redline"`` and fused-kernel backend ``"redline"`` to verl (idempotent)."""
    from verl.models.transformers import monkey_patch
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(BACKEND)(compute_policy_loss_redline)
    original = monkey_patch.patch_forward_with_backends
    if getattr(original, "_redline", False):
        return

    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if not (use_fused_kernels and fused_kernels_backend == BACKEND):
            return original(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)
        fusable_lm_head_weight(model)  # refuse an unsupported head at model build time
        if getattr(model.config, "vision_config", None) is not None:
            raise ValueError(f"fused_kernels_backend='redline' supports text-only models, "
                             f"got {model.config.model_type}")
        model._verl_fused_kernels_backend = BACKEND
        model.__class__.forward = forward_with_redline_backend

    patch_forward_with_backends._redline = True
    monkey_patch.patch_forward_with_backends = patch_forward_with_backends


__all__ = [
    "aggregation_scale",
    "compute_policy_loss_redline",
    "forward_with_redline_backend",
    "loss_config_from_verl",
    "register",
]
