"""What the RL policy loss computes (``LossConfig``) and the contract its input tensors must meet.

The math each field selects is written out in ``redline.kernels.reference.policy_loss_reference``.
Both the kernel and the reference check their inputs with ``check_policy_loss_inputs`` so a bad call fails
the same way whichever implementation runs.
"""

import math
from dataclasses import dataclass

import torch

ESTIMATORS = ("ppo", "gspo", "cispo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
TIS_MODES = (None, "truncate", "icepop")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _require_number(name: str, value, *, low: float | None = None, strict: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")


@dataclass(frozen=True)
class LossConfig:
    """Policy-loss settings (slime's ``--eps-clip``, ``--eps-clip-high``, ``--kl-loss-type`` ... in one place).

    ``eps_clip_high`` is resolved at construction: ``None`` becomes ``eps_clip`` for ppo/gspo, so after
    ``__post_init__`` it is always a float. cispo has no symmetric default and needs it explicitly.
    ``eps_clip_c`` (dual clip) applies to ppo/gspo only. ``tis_clip_low``/``tis_clip`` bound the
    train/inference importance weight when ``tis`` is set. ``agg`` is the loss aggregation (formulas in
    ``reference.policy_loss_reference``; the seq-mean modes divide by every sequence, empty ones included).
    ``agg_constant`` is the Dr.GRPO divisor of ``seq-mean-token-sum-norm`` and is accepted with that mode only.
    """

    estimator: str = "ppo"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    kl_type: str = "low_var_kl"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis: str | None = None
    tis_clip_low: float | None = 0.0
    tis_clip: float | None = 2.0
    agg: str = "token-mean"
    agg_constant: float | None = None

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        _require_number("eps_clip", self.eps_clip, low=0.0)
        if self.eps_clip_high is None:
            if self.estimator == "cispo":
                raise ValueError("eps_clip_high is required for estimator='cispo' (its upper ratio bound)")
            object.__setattr__(self, "eps_clip_high", float(self.eps_clip))
        _require_number("eps_clip_high", self.eps_clip_high, low=0.0)
        if self.eps_clip_c is not None:
            if self.estimator == "cispo":
                raise ValueError("eps_clip_c (dual clip) applies to ppo/gspo, not to estimator='cispo'")
            _require_number("eps_clip_c", self.eps_clip_c, low=1.0, strict=True)
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        _require_number("kl_coef", self.kl_coef)
        _require_number("entropy_coef", self.entropy_coef)
        if self.tis not in TIS_MODES:
            raise ValueError(f"tis must be one of {TIS_MODES}, got {self.tis!r}")
        if self.tis is not None:
            for name in ("tis_clip_low", "tis_clip"):
                if getattr(self, name) is None:
                    raise ValueError(f"{name} is required with tis={self.tis!r} (the weight's bounds)")
                _require_number(name, getattr(self, name), low=0.0)
            if self.tis_clip < self.tis_clip_low:
                raise ValueError(f"tis_clip ({self.tis_clip}) must be >= tis_clip_low ({self.tis_clip_low})")
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.agg == "seq-mean-token-sum-norm":
            if self.agg_constant is None:
                raise ValueError("agg_constant is required with agg='seq-mean-token-sum-norm' (Dr.GRPO divisor)")
            _require_number("agg_constant", self.agg_constant, low=0.0, strict=True)
        elif self.agg_constant is not None:
            raise ValueError(f"agg_constant is only used by agg='seq-mean-token-sum-norm', not {self.agg!r}")


def check_policy_loss_inputs(logp, old_logp, advantages, mask, *, cfg, ref_logp, rollout_logp, entropy,
                             cu_seqlens, float_dtypes=(torch.float32,)):
    """Raise ValueError naming the argument when the tensors do not meet the policy-loss contract.

    Per-token tensors are ``[T]`` of one dtype from ``float_dtypes`` on one device; ``mask`` is ``[T]`` bool;
    ``cu_seqlens`` is ``[S+1]`` int32, non-decreasing from 0 to T (its values are checked only for CPU tensors
    outside torch.compile, because reading a GPU tensor's values would be a host sync).
    """
    if not isinstance(cfg, LossConfig):
        raise ValueError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if not isinstance(logp, torch.Tensor) or logp.dim() != 1:
        raise ValueError(f"logp must be a 1-D tensor [T], got {getattr(logp, 'shape', type(logp))}")
    if logp.dtype not in float_dtypes:
        raise ValueError(f"logp must have dtype in {float_dtypes}, got {logp.dtype}")
    per_token = {"old_logp": old_logp, "advantages": advantages, "ref_logp": ref_logp,
                 "rollout_logp": rollout_logp, "entropy": entropy}
    for name, tensor in per_token.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.shape != logp.shape:
            raise ValueError(f"{name} must have shape {tuple(logp.shape)} like logp, "
                             f"got {getattr(tensor, 'shape', type(tensor))}")
        if tensor.dtype != logp.dtype or tensor.device != logp.device:
            raise ValueError(f"{name} must be {logp.dtype} on {logp.device} like logp, "
                             f"got {tensor.dtype} on {tensor.device}")
    if not isinstance(mask, torch.Tensor) or mask.shape != logp.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor of shape {tuple(logp.shape)}, "
                         f"got {getattr(mask, 'dtype', type(mask))} {getattr(mask, 'shape', '')}")
    if mask.device != logp.device:
        raise ValueError(f"mask must be on {logp.device} like logp, got {mask.device}")
    if cfg.kl_coef != 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when kl_coef != 0 (kl_coef={cfg.kl_coef})")
    if cfg.tis is not None and rollout_logp is None:
        raise ValueError(f"rollout_logp is required with tis={cfg.tis!r}")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy is required when entropy_coef != 0 (entropy_coef={cfg.entropy_coef})")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, logp)


def _check_cu_seqlens(cu_seqlens, logp):
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [S+1] with S >= 1, "
                         f"got {getattr(cu_seqlens, 'shape', type(cu_seqlens))}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != logp.device:
        raise ValueError(f"cu_seqlens must be int32 on {logp.device}, got {cu_seqlens.dtype} on {cu_seqlens.device}")
    # reading values is a host sync on a GPU and a graph break under torch.compile: eager CPU tensors only
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        total = logp.shape[0]
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != total:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={total}, "
                             f"got {int(cu_seqlens[0])} ... {int(cu_seqlens[-1])}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
