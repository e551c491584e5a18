"""nn.Module wrappers of the fused LM-head ops, for trainers that compose losses as modules (verl/TRL style).

Both modules take the LM head's weight at call time (``model.lm_head.weight``), so they hold no parameters
and work with tied embeddings, FSDP-gathered weights or a tensor-parallel shard alike.
"""

from typing import Optional

import torch
from torch import nn

from .linear_logprobs import fused_linear_logprobs
from .linear_policy_loss import fused_linear_policy_loss
from .loss_config import LossConfig


class FusedLinearLogprobs(nn.Module):
    """``forward(hidden [T,H], weight [V,H], targets [T], mask=None) -> (logp [T], entropy [T] or None)``."""

    def __init__(self, temperature: float = 1.0, return_entropy: bool = False, tp_group=None):
        super().__init__()
        self.temperature, self.return_entropy, self.tp_group = temperature, return_entropy, tp_group

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                mask: Optional[torch.Tensor] = None):
        return fused_linear_logprobs(hidden, weight, targets, temperature=self.temperature, mask=mask,
                                     return_entropy=self.return_entropy, tp_group=self.tp_group)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, return_entropy={self.return_entropy}"


class FusedLinearPolicyLoss(nn.Module):
    """``forward(hidden, weight, targets, old_logp, advantages, mask, ref_logp=None, rollout_logp=None,
    cu_seqlens=None) -> (loss [], metrics)`` with the ``LossConfig`` (and ``workspace_bytes``, ``one_pass`` as
    in ``fused_linear_policy_loss``) given at construction."""

    def __init__(self, cfg: LossConfig, temperature: float = 1.0, tp_group=None,
                 workspace_bytes: Optional[int] = None, one_pass: Optional[bool] = None):
        super().__init__()
        self.cfg, self.temperature, self.tp_group = cfg, temperature, tp_group
        self.workspace_bytes, self.one_pass = workspace_bytes, one_pass

    def forward(self, hidden, weight, targets, old_logp, advantages, mask, ref_logp=None, rollout_logp=None,
                cu_seqlens=None):
        return fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, cfg=self.cfg,
                                        temperature=self.temperature, ref_logp=ref_logp, rollout_logp=rollout_logp,
                                        cu_seqlens=cu_seqlens, tp_group=self.tp_group,
                                        workspace_bytes=self.workspace_bytes, one_pass=self.one_pass)

    def extra_repr(self) -> str:
        return f"cfg={self.cfg}, temperature={self.temperature}"
