"""Differentiable TP/SP collectives (Megatron's f/g operators), dim 0 being the packed-token dim.

=======================  ==========================  =============================
function                 forward                     backward
=======================  ==========================  =============================
``copy_to_tp``           identity                    all-reduce
``reduce_from_tp``       all-reduce                  identity
``gather_tokens``        all-gather (dim 0)          reduce-scatter (dim 0)
``reduce_scatter_tokens``  reduce-scatter (dim 0)    all-gather (dim 0)
``gather_replicated``    all-gather (any dim)        keep own slice
=======================  ==========================  =============================

``gather_tokens`` feeds a consumer that yields *partial* gradients (a column-parallel GEMM);
``gather_replicated`` one whose gradient is already complete on every rank (e.g. after ``copy_to_tp``).

``gather_tokens_linear`` is ``gather_tokens`` followed by ``F.linear`` in one function, so that its backward
overlaps the input gradient's reduce-scatter with the weight gradient's GEMM (Megatron's sequence-parallel
column linear).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13 renamed the single-tensor collectives (the old names warn there); torch 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    if dim == 0:  # straight into the output: no list of parts and no concatenation copy
        out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _start_reduce_scatter(x: torch.Tensor, group) -> tuple[torch.Tensor, dist.Work]:
    """The reduce-scatter of ``x`` over dim 0, launched: ``(out, work)``, ``out`` valid after ``work.wait()``."""
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence parallelism needs the token count ({x.shape[0]}) divisible by tp={size}")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, _reduce_scatter_single(out, x.contiguous(), group=group, async_op=True)


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    out, work = _start_reduce_scatter(x, group)
    work.wait()
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, 0), None


class _GatherTokensLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        gathered = _all_gather(x, group, 0)
        ctx.save_for_backward(gathered, weight)
        ctx.group = group
        return F.linear(gathered, weight)

    @staticmethod
    def backward(ctx, dy):
        gathered, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx, pending = _start_reduce_scatter(dy @ weight, ctx.group)
        dw = dy.t() @ gathered if ctx.needs_input_grad[1] else None  # while the reduce-scatter runs
        pending.wait()
        return dx, dw, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim, ctx.width = group, dim, x.shape[dim]
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        start = dist.get_rank(ctx.group) * ctx.width
        return grad.narrow(ctx.dim, start, ctx.width).contiguous(), None, None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_tokens(x, group):
    return _GatherTokens.apply(x, group)


def reduce_scatter_tokens(x, group):
    return _ReduceScatterTokens.apply(x, group)


def gather_tokens_linear(x, weight, group):
    """``F.linear(gather_tokens(x), weight)``: ``x [T/tp, in]``, ``weight [out/tp, in]`` -> ``[T, out/tp]``; the
    backward's reduce-scatter of ``dx`` runs beside the GEMM of ``dW``."""
    return _GatherTokensLinear.apply(x, weight, group)


def gather_replicated(x, group, dim):
    return _GatherReplicated.apply(x, group, dim)


def split_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous chunk of dim 0 (no gradient bookkeeping: used on inputs)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=0)[rank]
