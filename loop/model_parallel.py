"""The loop's passes through a tensor / pipeline parallel model (``redline.trainer.parallel``).

Under TP every rank of the TP group runs the whole stream (replicated ``input_ids``; with SP the layers split the
tokens themselves) and the LM head runs vocab-parallel: the fused kernels get the TP group (``tp_group``) and
reduce their row statistics and the hidden gradient over it. Under PP the stream passes through the stages: a
forward-only pass (log-probs) sends each micro-batch's activation on, stage by stage, and the last stage's
per-token results are broadcast back over the pipeline group; a training pass runs the 1F1B schedule
(``one_f_one_b``) over the step's token-budget micro-batches, the loss on the last stage, and its metrics are
broadcast so that every stage reports the same step.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from redline.trainer.models.seq_bounds import host_bounds, remember
from redline.trainer.padding import token_multiple


def tp_group_of(model):
    """The TP group the LM head's vocabulary is split over; None without tensor parallelism."""
    state = getattr(model, "parallel_state", None)
    return state.tp_group if state is not None and state.tp > 1 else None


def pipeline_state(model):
    """The ``ParallelState`` of a pipeline-split model (None without pipeline parallelism)."""
    return getattr(model, "pp_state", None)


def holds_lm_head(model) -> bool:
    """Whether this rank runs the LM head: every rank without pipeline parallelism, the last stage's (each of its
    TP ranks, a ``[V / tp, H]`` shard of the same shape on each, in every DP rank) under it."""
    state = pipeline_state(model)
    return state is None or state.pp_rank == state.pp - 1


def lm_head_leader(model) -> int:
    """The global rank of the first of the ranks that run the LM head (``holds_lm_head``): rank 0, or under
    pipeline parallelism DP and TP rank 0 of the last stage."""
    state = pipeline_state(model)
    return 0 if state is None else state.config.global_rank(0, state.pp - 1, 0)


def padded_stream(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, cu_seqlens)`` of ``batch`` padded to the model's token multiple (FP8 alignment, TP under SP)
    by extending its last sequence: causal attention keeps real tokens blind to the padding; cut the padded rows
    off the output (the first ``batch.num_tokens``)."""
    pad = -batch.input_ids.shape[0] % token_multiple(model)
    if pad == 0:
        return batch.input_ids, batch.cu_seqlens
    bounds = list(host_bounds(batch.cu_seqlens))  # recorded when the batch moved to the device: no read
    cu_seqlens = batch.cu_seqlens.clone()
    cu_seqlens[-1] += pad
    remember(cu_seqlens, bounds[:-1] + [bounds[-1] + pad])
    return torch.cat([batch.input_ids, batch.input_ids.new_zeros(pad)]), cu_seqlens


def _stage_hidden(model, batch, state) -> torch.Tensor | None:
    """Forward only: this stage's part of ``batch``; ``hidden [T, H]`` on the last stage, None elsewhere."""
    input_ids, cu_seqlens = padded_stream(model, batch)
    received = None
    if state.pp_rank > 0:
        reference = next(model.parameters())
        rows = input_ids.shape[0] // (state.tp if state.sp else 1)
        received = torch.empty(rows, model.spec.hidden_size, dtype=reference.dtype, device=reference.device)
        dist.recv(received, src=state.pp_peer(-1), group=state.pp_group)
    out = model(input_ids, cu_seqlens, hidden=received)
    if state.pp_rank < state.pp - 1:
        dist.send(out.contiguous(), dst=state.pp_peer(1), group=state.pp_group)
        return None
    return out[:batch.num_tokens]


def last_stage_outputs(model, batch, head: Callable, count: int) -> tuple[torch.Tensor, ...]:
    """``head(hidden)`` -> ``count`` per-token ``[T]`` fp32 tensors (no gradient), computed where the model's
    output is (the last stage) and the same on every stage of the pipeline."""
    state = pipeline_state(model)
    if state is None:
        from redline.loop.worker import _forward_hidden

        return tuple(head(_forward_hidden(model, batch)))
    hidden = _stage_hidden(model, batch, state)
    last = dist.get_global_rank(state.pp_group, state.pp - 1)
    outputs = head(hidden) if hidden is not None else [
        torch.empty(batch.num_tokens, dtype=torch.float32, device=batch.input_ids.device) for _ in range(count)]
    outputs = [t.float().contiguous() for t in outputs]
    for tensor in outputs:
        dist.broadcast(tensor, src=last, group=state.pp_group)
    return tuple(outputs)


def pipeline_totals(model, batches, weights: list[float], loss_fn: Callable) -> dict[str, float]:
    """Forward and backward of ``Σ weight · loss`` over ``batches`` through the pipeline (1F1B);
    ``loss_fn(batch, hidden=...) -> (loss, metrics)`` runs on the last stage. Returns the weighted sums of
    ``loss`` and each metric, the same dict on every stage."""
    from redline.trainer.parallel.pipeline import one_f_one_b

    state = pipeline_state(model)
    pending = iter(zip(batches, weights))
    totals: dict[str, torch.Tensor] = {}

    def stage_loss(hidden, micro_batch):
        batch, weight = next(pending)  # the last stage's forwards run in micro-batch order
        loss, metrics = loss_fn(batch, hidden=hidden[:batch.num_tokens])
        for key, value in {"loss": loss.detach(), **metrics}.items():
            totals[key] = totals.get(key, 0.0) + value.detach().float() * weight
        return loss * weight

    one_f_one_b(model, [padded_stream(model, b) for b in batches], stage_loss, state)
    box = [{k: float(v) for k, v in totals.items()}]
    dist.broadcast_object_list(box, src=dist.get_global_rank(state.pp_group, state.pp - 1), group=state.pp_group,
                               device=next(model.parameters()).device)
    return box[0]
