"""TRL's ``GRPOTrainer`` on redline's fused LM-head kernels: ``use_redline_kernels(trainer)``, one line.

After the call the trainer computes, from the policy's last hidden state and never as ``[B, T, V]`` logits,
* the training loss with ``fused_linear_policy_loss`` (completion log-probs, entropy, GRPO loss, dHidden, dW in
  one call), and
* the no-grad old / reference log-probs with ``fused_linear_logprobs``.
Everything else (generation, rewards, advantages, the optimizer) stays TRL's. TRL is imported here only when
``use_redline_kernels`` is called. Tested with TRL 1.12.0 and 1.16.0 (kernels/README.md, "With TRL").

How TRL's options become a ``LossConfig`` (``loss_config_from_trl``; per token t of completion i, r the ratio):
  loss_type grpo     seq-mean-token-mean over the B completions / gradient-accumulation steps
            bnpo     token-mean / gradient-accumulation steps
            dr_grpo  seq-mean-token-sum-norm, agg_constant = max_completion_length, / accumulation steps
            dapo     token-mean × (masked tokens / TRL's ``num_items_in_batch`` normalizer); cispo likewise
  epsilon, epsilon_high          eps_clip, eps_clip_high (cispo: eps_clip = 1, eps_clip_high = epsilon_high - 1,
                                 i.e. TRL's one-sided cap r <= epsilon_high)
  delta                          eps_clip_c: TRL's -min(min(r, δ)·A, clip(r)·A) is the dual clip where A < 0
                                 and the plain clip where A > 0 when δ > 1 + epsilon_high (required)
  importance_sampling_level      token: estimator ppo; sequence: gspo (r = exp of the masked mean log-ratio)
  beta                           kl_coef with kl_type k3 (TRL's exp(ref - logp) - (ref - logp) - 1, unclamped);
                                 needs use_bias_correction_kl=False (TRL multiplies that KL by r otherwise)
  vLLM importance sampling       TRL's own ``importance_sampling_ratio`` (any mode; already clipped or masked)
                                 multiplies the policy term, as tis="truncate" on rollout_logp = old - log(ratio)
Refused with a ValueError naming the option: loss types sapo, vespo, luspo; entropy_coef / adaptive entropy;
use_liger_kernel where it selects Liger's GRPO loss (TRL <= 1.12);
top_entropy_quantile < 1; off_policy_mask_threshold; MoE router aux loss; multimodal inputs; delta <= 1 +
epsilon_high; beta with use_bias_correction_kl.

The loss's metrics are logged as TRL's ``entropy``, ``kl`` and ``clip_ratio/region_mean`` (redline aggregates
entropy and kl like the loss, TRL as a token mean: equal for bnpo/dapo/cispo, a seq-mean for grpo/dr_grpo).
Without ``old_per_token_logps`` in the batch (on-policy steps) the old log-probs are the current ones: one more
no-grad LM-head forward from the same hidden state, 2·T·H·V FLOPs.
"""

import types
import warnings

import torch

from ..linear_logprobs import fused_linear_logprobs
from ..linear_policy_loss import fused_linear_policy_loss
from ..loss_config import LossConfig
from .common import WEIGHT_TIS, fusable_lm_head_weight, rollout_logp_for_weights

TESTED_TRL = ("1.12", "1.17")  # tests pass with 1.12.0 and 1.16.0 (setup.py's trl extra)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
MULTIMODAL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                     "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def loss_config_from_trl(args, *, use_vllm_is: bool = False) -> LossConfig:
    """The ``LossConfig`` a ``GRPOConfig`` asks for (module docstring); ValueError naming the TRL option that has
    no redline equivalent. ``use_vllm_is``: the trainer applies its vLLM importance-sampling correction."""
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"GRPOConfig.loss_type={args.loss_type!r} has no redline equivalent; "
                         f"use_redline_kernels supports {LOSS_TYPES}")
    refused = {
        "entropy_coef": args.entropy_coef != 0,
        "use_adaptive_entropy": args.use_adaptive_entropy,
        "top_entropy_quantile": args.top_entropy_quantile < 1.0,
        "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
    }
    for option, set_ in refused.items():
        if set_:
            raise ValueError(f"GRPOConfig.{option}={getattr(args, option)!r} is not supported by use_redline_kernels "
                             f"(redline's loss has no such term)")
    if args.importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"GRPOConfig.importance_sampling_level={args.importance_sampling_level!r} must be "
                         f"'token' or 'sequence'")
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    fields = {"estimator": "gspo" if args.importance_sampling_level == "sequence" else "ppo",
              "eps_clip": args.epsilon, "eps_clip_high": epsilon_high}
    if args.loss_type == "cispo":
        if args.importance_sampling_level != "token" or args.delta is not None or epsilon_high < 1:
            raise ValueError("GRPOConfig.loss_type='cispo' maps onto redline only with importance_sampling_level="
                             f"'token', delta=None and epsilon_high >= 1 (got {args.importance_sampling_level!r}, "
                             f"{args.delta!r}, {epsilon_high!r})")
        fields.update(estimator="cispo", eps_clip=1.0, eps_clip_high=epsilon_high - 1.0)
    elif args.delta is not None:
        if args.delta <= 1 + epsilon_high:
            raise ValueError(f"GRPOConfig.delta={args.delta} must be > 1 + epsilon_high={1 + epsilon_high} for "
                             f"redline's dual clip (eps_clip_c) to equal TRL's two-sided clipping")
        fields["eps_clip_c"] = args.delta
    if args.beta != 0:
        if args.use_bias_correction_kl:
            raise ValueError("GRPOConfig.use_bias_correction_kl=True (multiplying the KL by the ratio) has no redline "
                             "equivalent; set it to False to use beta with use_redline_kernels")
        fields.update(kl_type="k3", kl_coef=args.beta)
    if use_vllm_is:
        fields.update(WEIGHT_TIS)
    agg = {"grpo": {"agg": "seq-mean-token-mean"}, "bnpo": {"agg": "token-mean"}, "dapo": {"agg": "token-mean"},
           "cispo": {"agg": "token-mean"},
           "dr_grpo": {"agg": "seq-mean-token-sum-norm", "agg_constant": float(args.max_completion_length)}}
    return LossConfig(**fields, **agg[args.loss_type])


def use_redline_kernels(trainer):
    """Switch ``trainer`` (a ``trl.GRPOTrainer``, after construction, before ``train()``) onto redline's fused
    kernels; returns it. Raises ValueError naming the first TRL option redline cannot compute."""
    import trl
    from packaging.version import Version

    version = Version(trl.__version__)
    if version < Version(TESTED_TRL[0]):
        raise ValueError(f"use_redline_kernels replaces GRPOTrainer internals as TRL >= {TESTED_TRL[0]} has them "
                         f"(tested: 1.12.0, 1.16.0), found TRL {trl.__version__}")
    if version >= Version(TESTED_TRL[1]):
        warnings.warn(f"use_redline_kernels is tested with TRL {TESTED_TRL[0]} up to before {TESTED_TRL[1]}, found "
                      f"{trl.__version__}: it replaces GRPOTrainer._compute_loss, check that its loss still matches",
                      stacklevel=2)
    if not isinstance(trainer, trl.GRPOTrainer):
        raise TypeError(f"use_redline_kernels expects a trl.GRPOTrainer, got {type(trainer).__name__}")
    if trainer.args.use_liger_kernel and hasattr(trainer, "compute_liger_loss"):  # TRL <= 1.12: Liger's GRPO loss
        raise ValueError("GRPOConfig.use_liger_kernel=True computes the loss with Liger's GRPO loss in this TRL "
                         f"({trl.__version__}); use it or use_redline_kernels, not both")
    if trainer.aux_loss_enabled:
        raise ValueError("GRPOConfig / model router aux loss (MoE output_router_logits) is not supported by "
                         "use_redline_kernels")
    use_vllm_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    trainer._redline_loss_config = loss_config_from_trl(trainer.args, use_vllm_is=use_vllm_is)
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            _add_hidden_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
    trainer._compute_loss = types.MethodType(_compute_loss, trainer)
    trainer._get_per_token_logps_and_entropies = types.MethodType(_get_per_token_logps_and_entropies, trainer)
    return trainer


def _add_hidden_head(model) -> None:
    """Let ``model(..., redline_head=f)`` return ``f(last_hidden_state [B, L, H], lm_head weight [V, H])``: through
    the model's own call, so DDP/FSDP wrappers see a forward; without ``redline_head`` the forward is unchanged."""
    fusable_lm_head_weight(model)  # refuse an unsupported head now, not in the first step
    original_forward = model.forward

    def forward(self, *args, redline_head=None, **kwargs):
        if redline_head is None:
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        return redline_head(hidden, fusable_lm_head_weight(self))

    model.forward = types.MethodType(forward, model)


def _refuse_multimodal(inputs: dict) -> None:
    for name in MULTIMODAL_INPUTS:
        if inputs.get(name) is not None:
            raise ValueError(f"multimodal input {name!r} is not supported by use_redline_kernels (text-only models)")


def _completion_rows(self, hidden, weight, completion_ids):
    """``(rows [B·T, H], weight [V, H], targets [B·T])``: the hidden rows predicting the completion tokens and the
    head in one dtype, the hidden state's (as autocast would run the head) or fp32 with cast_lm_head_to_fp32."""
    length = completion_ids.shape[1]
    rows = hidden[:, -length - 1:-1].reshape(-1, hidden.shape[-1])
    dtype = torch.float32 if self.args.cast_lm_head_to_fp32 else rows.dtype
    return rows.to(dtype), weight.to(dtype), completion_ids.reshape(-1)


def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                       compute_entropy=False, compute_aux_loss=False, **multimodal):
    """TRL's contract (``logp [B, T]``, ``entropy [B, T]`` or None, None) through ``fused_linear_logprobs``."""
    _refuse_multimodal(multimodal)
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, attn = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        completion = ids[:, -logits_to_keep:]
        valid = attn[:, -logits_to_keep:].reshape(-1).bool()

        def head(hidden, weight, completion=completion, valid=valid):
            rows, weight, targets = _completion_rows(self, hidden, weight, completion)
            return fused_linear_logprobs(rows, weight, targets, temperature=self.temperature, mask=valid,
                                         return_entropy=compute_entropy)

        with self.accelerator.autocast():
            logp, entropy = model(input_ids=ids, attention_mask=attn, redline_head=head)
        logps.append(logp.view(completion.shape))
        if compute_entropy:
            entropies.append(entropy.view(completion.shape))
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None


def _loss_scale(self, inputs, mask, mode: str):
    """The factor from redline's normalised aggregation to TRL's (gradient accumulation; dapo's token count)."""
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
    if self.loss_type not in ("dapo", "cispo"):
        return 1.0 / accumulation
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * accumulation / self.args.steps_per_generation
    return mask.sum().clamp(min=1) / normalizer


def _compute_loss(self, model, inputs):
    """``GRPOTrainer._compute_loss`` through ``fused_linear_policy_loss`` (module docstring for the mapping)."""
    _refuse_multimodal(inputs)
    cfg = self._redline_loss_config
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    batch, length = completion_ids.shape
    flat_mask = mask.reshape(-1).bool()
    advantages = inputs["advantages"]
    advantages = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).expand(batch, length)
    per_token = {"advantages": advantages, "old_logp": inputs.get("old_per_token_logps"),
                 "ref_logp": inputs.get("ref_per_token_logps") if cfg.kl_coef != 0 else None}
    per_token = {k: None if v is None else v.reshape(-1).float().contiguous() for k, v in per_token.items()}
    cu_seqlens = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=completion_ids.device)

    def head(hidden, weight):
        rows, weight, targets = _completion_rows(self, hidden, weight, completion_ids)
        old_logp = per_token["old_logp"]
        if old_logp is None:  # on-policy: TRL's old log-probs are the current ones, detached
            with torch.no_grad():
                old_logp, _ = fused_linear_logprobs(rows, weight, targets, temperature=self.temperature,
                                                    mask=flat_mask)
        rollout_logp = None
        if cfg.tis is not None:
            ratio = inputs["importance_sampling_ratio"].expand(batch, length).reshape(-1)
            rollout_logp = rollout_logp_for_weights(old_logp, ratio)
        return fused_linear_policy_loss(rows, weight, targets, old_logp, per_token["advantages"], flat_mask, cfg=cfg,
                                        temperature=self.temperature, ref_logp=per_token["ref_logp"],
                                        rollout_logp=rollout_logp, cu_seqlens=cu_seqlens)

    with self.accelerator.autocast():
        loss, metrics = model(input_ids=input_ids, attention_mask=attention_mask, redline_head=head)
    mode = "train" if self.model.training else "eval"
    loss = loss * _loss_scale(self, inputs, mask, mode)
    logged = {"entropy": "entropy", "clip_ratio/region_mean": "clipfrac"}
    if cfg.kl_coef != 0:
        logged["kl"] = "kl"
    for trl_name, name in logged.items():
        self._metrics[mode][trl_name].append(self.accelerator.gather(metrics[name]).mean().item())
    return loss


__all__ = ["loss_config_from_trl", "use_redline_kernels"]
