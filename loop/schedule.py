"""Optimiser and learning-rate schedule."""

import math

import torch

from redline.config import TrainConfig
from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.trainer.parallel.optim import zero1_adamw


def build_optimizer(params, cfg: TrainConfig, lr: float | None = None,
                    dp: DataParallel = SINGLE_PROCESS) -> torch.optim.Optimizer:
    """AdamW, fused on CUDA (one kernel for all parameters). With several data-parallel ranks its states are
    sharded over them (ZeRO-1, ``ZeroRedundancyOptimizer``): each rank updates its share and broadcasts it."""
    params = [p for p in params if p.requires_grad]
    options = dict(lr=cfg.lr if lr is None else lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                   weight_decay=cfg.weight_decay, fused=bool(params) and params[0].is_cuda)
    if dp.world == 1:
        return torch.optim.AdamW(params, **options)
    return zero1_adamw(params, dp.state, **options)


def optimizer_state(optimizer, dp: DataParallel = SINGLE_PROCESS) -> dict | None:
    """The optimizer's whole state on rank 0 (None elsewhere). Collective under ZeRO-1: every rank must call it,
    the shards are gathered to rank 0."""
    if dp.world == 1:
        return optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if dp.is_main else None


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
