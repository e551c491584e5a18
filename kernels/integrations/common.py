"""What the TRL and verl adapters share: the LM head they may fuse, and a trainer's precomputed importance weights
expressed in ``LossConfig``'s terms."""

import torch

# A precomputed weight w is passed as rollout_logp = old_logp - log w with tis="truncate" between these bounds,
# so the loss applies exactly w (the trainer already clipped or masked it): redline's w = exp(old - rollout).
WEIGHT_TIS = {"tis": "truncate", "tis_clip_low": 0.0, "tis_clip": float(torch.finfo(torch.float32).max)}


def fusable_lm_head_weight(model) -> torch.Tensor:
    """The ``[V, H]`` weight of ``model``'s output embedding; ValueError where the head is more than ``h @ W.T``
    (a bias, logit soft-capping or a logit scale), which the fused kernels do not compute."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"redline's fused head needs a bias-free nn.Linear output embedding, "
                         f"got {type(head).__name__}")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                 "lm_head_multiplier"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(f"model.config.{name}={getattr(config, name)} is not computed by redline's fused head")
    weight = head.weight
    if hasattr(weight, "full_tensor"):  # an FSDP2 DTensor shard: the fused kernels need the whole [V, H] head
        weight = weight.full_tensor()
    return weight


def rollout_logp_for_weights(old_logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``old_logp - log(weights)``: with ``WEIGHT_TIS`` the loss multiplies each token's policy term by
    ``weights`` (``[T]``, >= 0, no gradient) up to fp32 rounding of exp(log w)."""
    return old_logp - torch.log(weights.detach().to(old_logp.dtype))
