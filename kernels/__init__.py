"""redline.kernels: fused LM-head log-prob/entropy and RL policy-loss kernels, usable on their own.

Importing this package needs only torch; Triton is imported when a CUDA tensor (or
``REDLINE_KERNELS_BACKEND=triton``) first needs it. See kernels/README.md for the contract.
"""

if __name__ != "redline.kernels":  # pragma: no cover - the repository root is on sys.path
    # This folder is the package redline.kernels. Imported under its bare folder name (as libraries probing for
    # a top-level "kernels" package do when the repository root is on sys.path), it would register its ops and
    # classes a second time; hand out the real package instead.
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("redline.kernels")
else:
    from .linear_logprobs import fused_linear_logprobs
    from .linear_policy_loss import fused_linear_policy_loss
    from .hf import causal_lm_logprobs
    from .loss_config import LossConfig
    from .modules import FusedLinearLogprobs, FusedLinearPolicyLoss
    from .policy_loss import policy_loss

    __all__ = ["fused_linear_logprobs", "fused_linear_policy_loss", "LossConfig", "policy_loss", "FusedLinearLogprobs",
               "FusedLinearPolicyLoss", "causal_lm_logprobs"]
