"""Gradient finalisation, clipping and the ZeRO-1 optimizer for a parallelised model."""

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from redline.trainer.parallel.config import ParallelState


def finalize_grads(model: nn.Module, state: ParallelState) -> None:
    """After the last backward of a step: sum partial TP gradients, average over DP, sum the tied
    embedding/LM-head pair across the first and last pipeline stages."""
    params = [p for p in model.parameters() if p.grad is not None]
    if state.tp > 1:
        for p in params:
            if getattr(p, "tp_partial_grad", False):
                dist.all_reduce(p.grad, group=state.tp_group)
    if state.config.dp > 1:
        average_over_dp(params, state)
    if state.pp > 1 and model.spec.tie_word_embeddings:
        # The first stage holds the embedding, the last its LM-head copy; middle stages add zeros so that the
        # collective is the same call on every stage.
        holder = model.embed_tokens if state.pp_rank == 0 else model.lm_head
        if holder is not None:
            dist.all_reduce(holder.weight.grad, group=state.pp_group)
        else:
            reference = next(model.parameters())
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
        if p.grad is None or getattr(p, "tied_copy", False):
            continue
        square = p.grad.float().square().sum()
        total += square if hasattr(p, "tp_shard") else square / state.tp
    for group, size in ((state.tp_group, state.tp), (state.pp_group, state.pp)):
        if size > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_grad_norm(model: nn.Module, state: ParallelState, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = grad_norm(model, state)
    torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, norm)
    return norm


def zero1_adamw(params, state: ParallelState, **adamw_options) -> torch.optim.Optimizer:
    """AdamW over ``params`` (those requiring grad) whose states are sharded over the DP group (ZeRO-1), via
    ``ZeroRedundancyOptimizer``; plain AdamW when dp = 1."""
    params = [p for p in params if p.requires_grad]
    if state.config.dp == 1:
        return torch.optim.AdamW(params, **adamw_options)
    return _zero1_class()(params, optimizer_class=torch.optim.AdamW, process_group=state.dp_group, **adamw_options)


@functools.cache
def _zero1_class():
    # made on first use: torch.distributed.optim TorchScript-compiles its functional optimizers on import
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class Zero1AdamW(ZeroRedundancyOptimizer):
        """``ZeroRedundancyOptimizer`` whose ``load_state_dict`` leaves a fused AdamW able to step: the base class
        moves every 0-dim state (AdamW's ``step``) to the CPU, and fused AdamW then refuses to step ("state_steps
        is on cpu"); they go back to their parameter's device."""

        def load_state_dict(self, state_dict) -> None:
            super().load_state_dict(state_dict)
            if not self.optim.defaults.get("fused"):
                return
            for param, param_state in self.optim.state.items():
                for key, value in param_state.items():
                    if torch.is_tensor(value) and value.dim() == 0 and value.device != param.device:
                        param_state[key] = value.to(param.device)

    return Zero1AdamW
