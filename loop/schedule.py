"""Optimiser and learning-rate schedule."""

import math

import torch

from redline.config import TrainConfig
from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.trainer.mixed_precision import MasterWeights, MixedPrecisionAdamW


def master_weights_for(model, cfg: TrainConfig, dp: DataParallel = SINGLE_PROCESS) -> MasterWeights | None:
    """fp32 master weights and gradients for ``model`` when it trains below fp32, under torchrun (the master
    shards are ZeRO-1's over DP; TP/PP gradients are finalised there) or with ``--optimizer-cpu-offload``; None:
    a single-process fp32 model steps its own parameters. With ``--offload-train`` always, their device buffers in
    the process's pausable memory
    (``redline.loop.train_offload``)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if cfg.offload_train:
        from redline.loop.train_offload import train_offload

        offload = train_offload(trainable[0].device)
        return offload.track(MasterWeights(model, parallel=dp.state, offload=cfg.optimizer_cpu_offload,
                                           allocate=offload.allocate))
    if all(p.dtype == torch.float32 for p in trainable) and dp.state is None and not cfg.optimizer_cpu_offload:
        return None
    return MasterWeights(model, parallel=dp.state, offload=cfg.optimizer_cpu_offload)


def build_optimizer(params, cfg: TrainConfig, lr: float | None = None,
                    master: MasterWeights | None = None) -> torch.optim.Optimizer:
    """AdamW at ``lr`` (default ``--lr``): over ``master``'s fp32 shards when given (``MixedPrecisionAdamW``),
    else torch's AdamW over ``params``, fused on CUDA (one kernel for all parameters)."""
    options = dict(lr=cfg.lr if lr is None else lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                   weight_decay=cfg.weight_decay)
    if master is not None:
        return MixedPrecisionAdamW(master, **options)
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, fused=bool(params) and params[0].is_cuda, **options)


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
