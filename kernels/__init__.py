"""redline.kernels: fused LM-head log-prob/entropy and RL policy-loss kernels, usable on their own.

Importing this package needs only torch; Triton is imported when a CUDA tensor (or
``REDLINE_KERNELS_BACKEND=triton``) first needs it. See kernels/README.md for the contract.
"""

from .linear_logprobs import fused_linear_logprobs
from .linear_policy_loss import fused_linear_policy_loss
from .hf import causal_lm_logprobs
from .loss_config import LossConfig
from .modules import FusedLinearLogprobs, FusedLinearPolicyLoss
from .policy_loss import policy_loss

__all__ = ["fused_linear_logprobs", "fused_linear_policy_loss", "LossConfig", "policy_loss", "FusedLinearLogprobs",
           "FusedLinearPolicyLoss", "causal_lm_logprobs"]
