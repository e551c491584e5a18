"""Optimiser and learning-rate schedule."""

import math

import torch

from redline.config import TrainConfig


def build_optimizer(params, cfg: TrainConfig, lr: float | None = None) -> torch.optim.AdamW:
    """AdamW, fused on CUDA (one kernel for all parameters)."""
    params = [p for p in params if p.requires_grad]
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(params, lr=cfg.lr if lr is None else lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             weight_decay=cfg.weight_decay, fused=fused)


def lr_factor(step: int, warmup: int, total: int, style: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warmup then constant or cosine."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, cfg: TrainConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    min_ratio = cfg.min_lr / cfg.lr if cfg.lr else 0.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.lr_warmup_iters, total_steps, cfg.lr_decay_style, min_ratio))
