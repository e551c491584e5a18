"""Pipeline parallelism: stage split by layer and a 1F1B schedule over packed micro-batches.

Our own schedule rather than ``torch.distributed.pipelining``: RL micro-batches have a different token count
each, which its fixed receive buffers do not allow (pytorch#159942). Here every stage is handed every
micro-batch's ``input_ids``/``cu_seqlens``, so each one knows the shape of the activation it receives and no
shape exchange is needed.
"""

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from redline.trainer.parallel.config import ParallelState


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layer indices of ``stage``: contiguous, the first ``num_layers % pp`` stages one layer longer."""
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers={num_layers} is less than pp={pp}")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def split_stage(model: nn.Module, state: ParallelState) -> nn.Module:
    """Keep this stage's layers (names unchanged); the first stage keeps the embedding, the last the final norm
    and LM head. With tied embeddings the last stage gets its own ``lm_head`` copy of the embedding, kept equal
    to it by summing their gradients (``finalize_grads``)."""
    first, last = state.pp_rank == 0, state.pp_rank == state.pp - 1
    keep = {str(i) for i in stage_layers(len(model.layers), state.pp, state.pp_rank)}
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


MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input_ids [T], cu_seqlens [S+1])


def one_f_one_b(stage: nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: Callable,
                state: ParallelState) -> list[torch.Tensor]:
    """Run forward and backward of every micro-batch through the pipeline, 1F1B order.

    ``loss_fn(hidden [T, H], micro_batch) -> scalar`` runs on the last stage (scale it for the number of
    micro-batches yourself); returns its detached losses there, ``[]`` elsewhere. Gradients accumulate in
    ``.grad``. Stage boundaries carry ``[T, H]`` (``[T/tp, H]`` with SP) in the parameters' dtype.
    """
    first, last = state.pp_rank == 0, state.pp_rank == state.pp - 1
    reference = next(stage.parameters())
    hidden_size, dtype, device = stage.spec.hidden_size, reference.dtype, reference.device
    tokens_per_rank = state.tp if state.sp else 1
    pending_sends, in_flight, losses = [], deque(), []

    def forward(micro_batch):
        input_ids, cu_seqlens = micro_batch
        received = None
        if not first:
            received = torch.empty(input_ids.shape[0] // tokens_per_rank, hidden_size, dtype=dtype, device=device)
            dist.recv(received, src=state.pp_peer(-1))
            received.requires_grad_()
        out = stage(input_ids, cu_seqlens, hidden=received)
        if last:
            loss = loss_fn(out, micro_batch)
            losses.append(loss.detach())
            out = loss
        else:
            pending_sends.append(dist.isend(out.detach().contiguous(), dst=state.pp_peer(1)))
        in_flight.append((received, out))

    def backward():
        received, out = in_flight.popleft()
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=state.pp_peer(1))
            out.backward(grad)
        if not first:
            pending_sends.append(dist.isend(received.grad.contiguous(), dst=state.pp_peer(-1)))

    warmup = min(state.pp - state.pp_rank - 1, len(micro_batches))
    for micro_batch in micro_batches[:warmup]:
        forward(micro_batch)
    for micro_batch in micro_batches[warmup:]:
        forward(micro_batch)
        backward()
    while in_flight:
        backward()
    for work in pending_sends:
        work.wait()
    return losses
