"""Async TP: under sequence parallelism, SP's token all-gather (before a column-parallel GEMM) and reduce-scatter
(after a row-parallel one) micro-pipelined with that GEMM by PyTorch's symmetric-memory fused ops: while the
GEMM runs on one rank's token chunk, the next chunk is copied over NVLink.

AG/RS are over dim 0 (tokens) within the TP group; ``x`` and ``dy`` are ``[tokens, features]``.

* ``all_gather_linear`` (column parallel): forward ``y = AG(x) W^T`` in ``fused_all_gather_matmul``, which
  also returns ``AG(x)``, kept for ``dW``; backward ``dx = RS(dy W)`` in ``fused_matmul_reduce_scatter`` and
  ``dW = dy^T AG(x)``.
* ``linear_reduce_scatter`` (row parallel): forward ``y = RS(x W^T)`` in ``fused_matmul_reduce_scatter``;
  backward ``AG(dy)`` and ``dx = AG(dy) W`` in ``fused_all_gather_matmul``, and ``dW = AG(dy)^T x``.

The ops (``torch.distributed._symmetric_memory``, same schema in torch 2.11 and 2.13):
``fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, *, return_A=True) -> (AG(A_shard), [AG(A_shard) @ B
for B in Bs])`` and ``fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name) -> RS(A @ B)``.

They equal ``gather_tokens`` / ``reduce_scatter_tokens`` around ``F.linear`` up to summation order (the fused
reduce-scatter adds the ranks' partial products in one ``torch.sum``, NCCL's ring adds them pairwise).
Token counts must divide by tp, as under SP anyway. The symmetric-memory buffers need every rank of the TP
group in one NVLink (P2P) domain, as TP is in practice.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

TP_OVERLAPS = ("auto", "off", "symm_mem")
FUSED_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")  # in torch.ops.symm_mem


def check_tp_overlap(overlap: str, sequence_parallel: bool) -> None:
    """ValueError for an ``overlap`` outside ``TP_OVERLAPS``, or ``"symm_mem"`` without sequence parallelism."""
    if overlap not in TP_OVERLAPS:
        raise ValueError(f"tp_overlap={overlap!r} is unknown; expected one of {TP_OVERLAPS}")
    if overlap == "symm_mem" and not sequence_parallel:
        raise ValueError("tp_overlap='symm_mem' needs sequence parallelism (sp=True): it overlaps SP's token "
                         "all-gather/reduce-scatter with the GEMMs")


def use_symm_mem(overlap: str, group, sequence_parallel: bool, backend, device: torch.device) -> bool:
    """Whether the TP layers of a model built with layer ``backend`` on ``device`` run the fused ops: ``"off"``
    never, ``"auto"`` wherever they can, ``"symm_mem"`` always (ValueError naming what is missing where they
    cannot). When they will, symmetric memory is enabled for ``group``."""
    check_tp_overlap(overlap, sequence_parallel)
    if overlap == "off" or not sequence_parallel:
        return False
    missing = _symm_mem_missing(group, backend, device)
    if missing is not None:
        if overlap == "symm_mem":
            raise ValueError(f"tp_overlap='symm_mem' needs {missing}; use 'auto' or 'off'")
        return False
    _enable_symm_mem(group)
    return True


def _symm_mem_missing(group, backend, device: torch.device) -> str | None:
    """What the fused ops need that this setting lacks, or None."""
    if backend.name == "te" or getattr(backend, "matmul", None) is not F.linear:
        return (f"the bf16 layer backend (an F.linear matmul); backend {backend.name!r} keeps its own "
                "TP communication")
    process_group_backend = str(dist.get_backend(group))
    if "nccl" not in process_group_backend or device.type != "cuda":
        return (f"an NCCL process group on CUDA tensors (the TP group's backend is {process_group_backend!r}, "
                f"the model is on {device.type!r})")
    if len(fused_ops()) != len(FUSED_OPS):
        return (f"torch.ops.symm_mem.fused_all_gather_matmul and fused_matmul_reduce_scatter, which torch "
                f"{torch.__version__} does not have")
    return None


def fused_ops() -> list:
    """The ``FUSED_OPS`` overloads this torch has (none without ``torch.distributed._symmetric_memory``)."""
    try:
        import torch.distributed._symmetric_memory  # defines the torch.ops.symm_mem operators
    except ImportError:
        return []
    return [getattr(torch.ops.symm_mem, name).default for name in FUSED_OPS if hasattr(torch.ops.symm_mem, name)]


def _enable_symm_mem(group) -> None:
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():
        # deprecated from torch 2.11 (rendezvous finds the group's store by itself), required before
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group.group_name)


class _AllGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group_name):
        gathered, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(x.contiguous(), [weight.t()], 0, group_name)
        ctx.save_for_backward(gathered, weight)
        ctx.group_name = group_name
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.ops.symm_mem.fused_matmul_reduce_scatter(dy, weight, "sum", 0, ctx.group_name)
        dw = dy.t() @ gathered if ctx.needs_input_grad[1] else None
        return dx, dw, None


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group_name):
        ctx.save_for_backward(x, weight)
        ctx.group_name = group_name
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, weight.t(), "sum", 0, group_name)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy_gathered, (dx,) = torch.ops.symm_mem.fused_all_gather_matmul(dy.contiguous(), [weight], 0,
                                                                          ctx.group_name)
        dw = dy_gathered.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw, None


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``gather_tokens(x) @ weight^T``: ``x [T/tp, in]``, ``weight [out/tp, in]`` -> ``[T, out/tp]``."""
    return _AllGatherLinear.apply(x, weight, group.group_name)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``reduce_scatter_tokens(x @ weight^T)``: ``x [T, in/tp]``, ``weight [out, in/tp]`` -> ``[T/tp, out]``."""
    return _LinearReduceScatter.apply(x, weight, group.group_name)
