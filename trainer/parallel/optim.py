"""Gradient finalisation and clipping for a parallelised model; its ZeRO-1 optimizer state lives in
``redline.trainer.mixed_precision``."""

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from redline.trainer.parallel.config import ParallelState


def param_grad(p: nn.Parameter) -> torch.Tensor | None:
    """The gradient a step uses: the fp32 ``main_grad`` of mixed-precision training
    (``redline.trainer.mixed_precision``), else ``.grad``."""
    return getattr(p, "main_grad", p.grad)


def finalize_grads(model: nn.Module, state: ParallelState, *, average_dp: bool = True) -> None:
    """After the last backward of a step: sum partial TP gradients, average over DP (unless ``average_dp`` is
    False: mixed precision reduces its flat fp32 buffer itself), sum the tied embedding/LM-head pair across the
    first and last pipeline stages."""
    params = [p for p in model.parameters() if param_grad(p) is not None]
    if state.tp > 1:
        for p in params:
            if getattr(p, "tp_partial_grad", False):
                dist.all_reduce(param_grad(p), group=state.tp_group)
    if state.config.dp > 1 and average_dp:
        average_over_dp(params, state)
    if state.pp > 1 and model.spec.tie_word_embeddings:
        # The first stage holds the embedding, the last its LM-head copy; middle stages add zeros so that the
        # collective is the same call on every stage.
        holder = model.embed_tokens if state.pp_rank == 0 else model.lm_head
        if holder is not None:
            dist.all_reduce(param_grad(holder.weight), group=state.pp_group)
        else:
            reference = param_grad(params[0])  # the dtype the other stages reduce in
            zeros = torch.zeros(model.spec.vocab_size // state.tp, model.spec.hidden_size, dtype=reference.dtype,
                                device=reference.device)
            dist.all_reduce(zeros, group=state.pp_group)


DP_BUCKET_BYTES = 256 * 2**20


def average_over_dp(params: list[nn.Parameter], state: ParallelState) -> None:
    """Average the gradients over the DP group: one all-reduce per bucket of at most ``DP_BUCKET_BYTES`` of
    one dtype (a tensor larger than that is its own bucket) on a flat copy, SUM then divide (gloo has no AVG),
    instead of one collective per tensor; the copies never exceed one bucket."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, list] = {}  # dtype -> [its bucket being filled, that bucket's bytes]
    for p in params:
        size = p.grad.numel() * p.grad.element_size()
        entry = open_bucket.get(p.grad.dtype)
        if entry is None or entry[1] + size > DP_BUCKET_BYTES:
            entry = open_bucket[p.grad.dtype] = [[], 0]
            buckets.append(entry[0])
        entry[0].append(p.grad)
        entry[1] += size
    for grads in buckets:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=state.dp_group)
        flat.div_(state.config.dp)
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)


def grad_norm(model: nn.Module, state: ParallelState) -> torch.Tensor:
    """Global L2 norm of the gradients: shards summed over TP, stages over PP, replicated tensors counted once
    (and the tied LM-head copy not at all)."""
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in model.parameters():
        grad = param_grad(p)
        if grad is None or getattr(p, "tied_copy", False):
            continue
        square = grad.float().square().sum()
        total += square if hasattr(p, "tp_shard") else square / state.tp
    for group, size in ((state.tp_group, state.tp), (state.pp_group, state.pp)):
        if size > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_grad_norm(model: nn.Module, state: ParallelState, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = grad_norm(model, state)
    grads = [g for g in map(param_grad, model.parameters()) if g is not None]
    torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))  # torch's clip_grad_norm_ factor
    return norm
