"""Pipeline parallelism: stage split by layer and a 1F1B schedule over packed micro-batches.

Our own schedule rather than ``torch.distributed.pipelining``: RL micro-batches have a different token count
each, which its fixed receive buffers do not allow (pytorch#159942). Here every stage is handed every
micro-batch's ``input_ids``/``cu_seqlens``, so each one knows the shape of the activation it receives and no
shape exchange is needed.
"""

import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from redline.trainer.parallel.config import ParallelState
from redline.trainer.parallel.stages import stage_layers


def split_stage(model: nn.Module, state: ParallelState) -> nn.Module:
    """Keep this stage's layers (``ParallelState.stage_sizes``; names unchanged); the first stage keeps the
    embedding, the last the final norm and LM head. With tied embeddings the last stage gets its own ``lm_head``
    copy of the embedding, kept equal to it by summing their gradients (``finalize_grads``)."""
    first, last = state.pp_rank == 0, state.pp_rank == state.pp - 1
    keep = {str(i) for i in stage_layers(state.stage_sizes(model.spec), state.pp_rank)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if last and model.lm_head is None:
        head = nn.Linear(model.spec.hidden_size, model.spec.vocab_size, bias=False,
                         dtype=model.embed_tokens.weight.dtype, device=model.embed_tokens.weight.device)
        head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
        head.weight.tied_copy = True
        if hasattr(model.embed_tokens.weight, "tp_shard"):
            head.weight.tp_shard = model.embed_tokens.weight.tp_shard
        model.lm_head = head
    if not first:
        model.embed_tokens = None
    if not last:
        model.norm = None
        model.lm_head = None
    model.pp_state = state
    return model


@torch.no_grad()
def broadcast_stages(announced: list[tuple[object, torch.Size, torch.dtype]], tensors: Iterator[torch.Tensor],
                     state: ParallelState, device) -> Iterator[tuple[object, torch.Tensor]]:
    """Every stage's tensors on every stage of the pipeline, stage 0's first: ``(key, tensor)``.

    ``announced`` lists this stage's tensors as ``(key, shape, dtype)`` (keys must pickle); ``tensors`` produces
    them in that order, lazily. The announcements travel once (``all_gather_object`` over the PP group), then
    each tensor is broadcast from its stage over the PP group: one tensor in flight at a time, and the same
    collectives on gloo and NCCL. Every rank of the PP group must iterate to the end.
    """
    everyone = [None] * state.pp
    dist.all_gather_object(everyone, announced, group=state.pp_group)
    for stage, entries in enumerate(everyone):
        source = dist.get_global_rank(state.pp_group, stage)
        for key, shape, dtype in entries:
            if stage == state.pp_rank:
                tensor = next(tensors).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=state.pp_group)
            yield key, tensor


MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input_ids [T], cu_seqlens [S+1])


def _exchange(group, *, send_next=None, recv_next=None, send_prev=None, recv_prev=None, peers=(None, None)):
    """Post this stage's sends and receives of one schedule step together, then wait for all of them.

    Batched because of NCCL: its point-to-point calls on one communicator run in order on one stream, so two
    stages that each block in a lone send before their receive (activation forward, gradient back) wait for each
    other forever once a message is larger than NCCL's internal buffer. Each step's batch here matches the
    neighbour's batch of the same step (Megatron's ``send_forward_recv_backward`` pairing)."""
    prev, nxt = peers
    ops = [dist.P2POp(op, tensor, peer, group=group) for op, tensor, peer in (
        (dist.isend, send_next, nxt), (dist.irecv, recv_next, nxt), (dist.isend, send_prev, prev),
        (dist.irecv, recv_prev, prev)) if tensor is not None]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _init_pipeline_group(state: ParallelState, device: torch.device) -> None:
    """One small all-reduce on the pipeline group before its first batched send/receive: NCCL creates the
    group's communicator at its first collective, which every rank of the group must enter."""
    if not getattr(state, "pipeline_group_ready", False):
        dist.all_reduce(torch.zeros(1, device=device), group=state.pp_group)
        state.pipeline_group_ready = True


def one_f_one_b(stage: nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: Callable,
                state: ParallelState) -> list[torch.Tensor]:
    """Run forward and backward of every micro-batch through the pipeline, 1F1B order.

    ``loss_fn(hidden [T, H], micro_batch) -> scalar`` runs on the last stage (scale it for the number of
    micro-batches yourself); returns its detached losses there, ``[]`` elsewhere. Gradients accumulate in
    ``.grad``. Stage boundaries carry ``[T, H]`` (``[T/tp, H]`` with SP) in the parameters' dtype; every stage
    sizes its receive buffers from the micro-batches' token counts, so no shapes travel.
    """
    first, last = state.pp_rank == 0, state.pp_rank == state.pp - 1
    reference = next(stage.parameters())
    hidden_size, dtype, device = stage.spec.hidden_size, reference.dtype, reference.device
    tokens_per_rank = state.tp if state.sp else 1
    for input_ids, _ in micro_batches:
        if input_ids.shape[0] % tokens_per_rank:
            raise ValueError(f"sequence parallelism needs every micro-batch's token count divisible by "
                             f"tp={state.tp}, got {input_ids.shape[0]} (pad with redline.trainer.padding)")
    _init_pipeline_group(state, device)
    exchange = functools.partial(_exchange, state.pp_group, peers=(None if first else state.pp_peer(-1),
                                                                   None if last else state.pp_peer(1)))
    in_flight, losses = deque(), []

    def input_buffer(index):
        """The activation buffer micro-batch ``index`` arrives in (None on the first stage / past the end)."""
        if first or index >= len(micro_batches):
            return None
        tokens = micro_batches[index][0].shape[0] // tokens_per_rank
        return torch.empty(tokens, hidden_size, dtype=dtype, device=device)

    def forward(micro_batch, received):
        """Run the stage; returns the activation to send on (None on the last stage)."""
        input_ids, cu_seqlens = micro_batch
        if received is not None:
            received.requires_grad_()
        out = stage(input_ids, cu_seqlens, hidden=received)
        if last:
            out = loss_fn(out, micro_batch)
            losses.append(out.detach())
        in_flight.append((received, out))
        return None if last else out.detach()

    def grad_buffer():
        """The buffer the gradient of the oldest in-flight output arrives in (None on the last stage)."""
        return None if last else torch.empty_like(in_flight[0][1])

    def backward(grad):
        """Backward of the oldest in-flight micro-batch; returns the gradient to send back (None on stage 0)."""
        received, out = in_flight.popleft()
        out.backward(grad)
        return None if first else received.grad

    count = len(micro_batches)
    warmup = min(state.pp - state.pp_rank - 1, count)
    for index in range(warmup):
        received = input_buffer(index)
        exchange(recv_prev=received)
        exchange(send_next=forward(micro_batches[index], received))
    received = input_buffer(warmup)
    exchange(recv_prev=received)
    for index in range(warmup, count):
        sent = forward(micro_batches[index], received)
        grad = grad_buffer()
        exchange(send_next=sent, recv_next=grad)
        received = input_buffer(index + 1)
        exchange(send_prev=backward(grad), recv_prev=received)
    for _ in range(warmup):
        grad = grad_buffer()
        exchange(recv_next=grad)
        exchange(send_prev=backward(grad))
    return losses
