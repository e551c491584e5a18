"""Tensor (and sequence) parallelism applied to a built ``DecoderModel`` from outside.

Each module keeps its parameters (now sharded in place) and its names; only its forward changes, by turning it
into the parallel subclass of its own class (``_become``). Layout (Megatron's):

* QKV and gate/up (``NormLinear``): column parallel; each fused part (q, k, v / gate, up) is sharded separately,
  so every rank holds whole heads and matching gate/up rows. With SP the norm runs on the local tokens and the
  normalised tokens are all-gathered before the GEMM.
* o_proj and down: row parallel; output all-reduced, or reduce-scattered over tokens with SP; bias after.
* Async TP (``tp_overlap``, bf16 backend under SP): the column-parallel gather and the row-parallel
  reduce-scatter run inside the layer's ``matmul``, micro-pipelined with the GEMM (``async_tp``). Without it the
  bf16 backend's column-parallel ``matmul`` under SP is ``comm.gather_tokens_linear``: the gather first, and in
  backward the input gradient's reduce-scatter beside the weight gradient's GEMM.
* Embedding and LM head: vocab parallel (the LM head is the embedding when tied, so both shard the same way).
* Replicated parameters that see only part of the data get partial gradients (``tp_partial_grad``):
  per-head q/k norms always, and with SP the norms and the row-parallel biases. ``finalize_grads`` sums them.

Parameter shards carry ``tp_shard`` (a ``ShardInfo``) so export and gradient checks can rebuild full tensors.
"""

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from redline.trainer.layers.torch_layers import Linear, NormLinear, RMSNorm
from redline.trainer.models.export import optional_param
from redline.trainer.parallel.async_tp import all_gather_linear, linear_reduce_scatter, use_symm_mem
from redline.trainer.parallel.comm import (copy_to_tp, gather_replicated, gather_tokens, gather_tokens_linear,
                                           reduce_from_tp, reduce_scatter_tokens)


@dataclass(frozen=True)
class ShardInfo:
    """A parameter sharded over ``group`` along ``dim``; ``parts`` (fused outputs) are sharded one by one."""

    dim: int
    group: object
    parts: tuple[int, ...] | None = None

    def full_shape(self, shard: torch.Tensor) -> torch.Size:
        shape = list(shard.shape)
        shape[self.dim] *= dist.get_world_size(self.group)
        return torch.Size(shape)

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(pieces, shard.contiguous(), group=self.group)
        return self.assemble(pieces)

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in group rank order (fused parts put back one by one)."""
        if self.parts is None:
            return torch.cat(pieces, dim=self.dim)
        local = [p // len(pieces) for p in self.parts]
        split = [piece.split(local, dim=self.dim) for piece in pieces]
        return torch.cat([torch.cat([s[i] for s in split], dim=self.dim) for i in range(len(local))], dim=self.dim)


def _shard(param: nn.Parameter, dim: int, group, parts=None) -> nn.Parameter:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = param.detach().split(list(parts), dim=dim) if parts else (param.detach(),)
    for chunk in chunks:
        if chunk.shape[dim] % size:
            raise ValueError(f"cannot shard a dim of {chunk.shape[dim]} over tp={size}")
    local = torch.cat([c.chunk(size, dim=dim)[rank] for c in chunks], dim=dim).clone()
    sharded = nn.Parameter(local, requires_grad=param.requires_grad)
    sharded.tp_shard = ShardInfo(dim, group, tuple(parts) if parts else None)
    return sharded


def _become(module: nn.Module, cls: type, **attributes) -> None:
    """Give ``module`` the forward of ``cls`` (a subclass of its class), keeping its parameters and names."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} does not extend {type(module).__name__}")
    module.__class__ = cls
    for name, value in attributes.items():
        setattr(module, name, value)


def _mark_partial(param: nn.Parameter | None) -> None:
    if param is not None:
        param.tp_partial_grad = True


class ColumnParallelNormLinear(NormLinear):
    """With ``matmul_gathers`` the ``matmul`` gathers the tokens itself (``all_gather_linear`` under async TP,
    ``gather_tokens_linear`` otherwise on the bf16 backend under SP)."""

    def forward(self, x):
        x = self.normalize(x)
        if not self.matmul_gathers:
            x = gather_tokens(x, self.tp_group) if self.sequence_parallel else copy_to_tp(x, self.tp_group)
        return self.project(x)


class RowParallelLinear(Linear):
    """Under ``async_tp`` the ``matmul`` is ``linear_reduce_scatter``: it reduce-scatters the tokens itself."""

    def forward(self, x):
        y = self.project(x, with_bias=False)
        if not self.async_tp:
            y = reduce_scatter_tokens(y, self.tp_group) if self.sequence_parallel else reduce_from_tp(
                y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[vocab_start, vocab_start + V/tp)``; other ids contribute zeros, summed over the group."""

    def forward(self, input_ids):
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_tokens(out, self.tp_group) if self.sequence_parallel else reduce_from_tp(
            out, self.tp_group)


class GatheringRMSNorm(RMSNorm):
    """Final norm under SP: normalise the local tokens, hand every rank the full ``[T, H]``, which then has
    the same contract as without SP (replicated; consumers such as ``vocab_parallel_logits`` complete the
    gradient with ``copy_to_tp``)."""

    def forward(self, x):
        return gather_replicated(super().forward(x), self.tp_group, 0)


def vocab_parallel_logits(hidden: torch.Tensor, weight_shard: torch.Tensor, group) -> torch.Tensor:
    """Full ``[T, V]`` logits from replicated ``hidden [T, H]`` and this rank's ``[V/tp, H]`` rows."""
    return gather_replicated(copy_to_tp(hidden, group) @ weight_shard.t(), group, -1)


class TensorParallelLogits:
    """Mixed into the model class: ``logits()`` gathers the vocab shards (tests/debugging only)."""

    def logits(self, input_ids, cu_seqlens):
        return vocab_parallel_logits(self.forward(input_ids, cu_seqlens), self.lm_head_weight(), self.tp_group)


@torch.no_grad()
def _te_parallel(backend, module, mode: str, group, sequence_parallel: bool) -> nn.Module:
    """A TE module rebuilt with TE's own tensor parallelism (``mode`` column/row), holding ``module``'s shards."""
    parallel = dict(parallel_mode=mode, tp_group=group, sequence_parallel=sequence_parallel)
    if mode == "column":
        new = backend.norm_linear(**module.build_args, **parallel)
        parts = module.out_parts
        new.norm_weight.copy_(module.norm_weight)
        pairs = [("weight", 0, parts), ("bias", 0, parts)]
        if sequence_parallel:
            _mark_partial(new.norm_weight)
    else:
        new = backend.linear(**module.build_args, **parallel)
        pairs = [("weight", 1, None)]
        if optional_param(module, "bias") is not None:
            optional_param(new, "bias").copy_(module.bias)
            if sequence_parallel:
                _mark_partial(optional_param(new, "bias"))
    for kind, dim, parts in pairs:
        old, target = optional_param(module, kind), optional_param(new, kind)
        if old is not None:
            shard = _shard(old, dim, group, parts)
            target.copy_(shard)
            target.tp_shard = shard.tp_shard
    return new


def _apply_te_tensor_parallel(model, layer, group, sequence_parallel: bool) -> None:
    tp = dist.get_world_size(group)
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv = _te_parallel(model.backend, attn.qkv, "column", group, sequence_parallel)
    mlp.gate_up = _te_parallel(model.backend, mlp.gate_up, "column", group, sequence_parallel)
    attn.o_proj = _te_parallel(model.backend, attn.o_proj, "row", group, sequence_parallel)
    mlp.down = _te_parallel(model.backend, mlp.down, "row", group, sequence_parallel)
    spec = model.spec
    attn.core = model.backend.attention(spec.num_heads // tp, spec.num_kv_heads // tp, spec.head_dim)


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool, tp_overlap: str = "auto") -> None:
    """Shard a built ``DecoderModel`` over ``group`` in place (any backend: the ``te`` one is rebuilt with TE's
    own ``tp_group``/``sequence_parallel``, the others get the parallel layers of this module).

    ``tp_overlap`` (``async_tp.TP_OVERLAPS``): ``"symm_mem"`` runs the SP collectives of the bf16 backend's
    layers as symmetric-memory fused GEMMs (``async_tp``; ValueError where they cannot run), ``"auto"`` does so
    wherever they can (SP, bf16 backend, NCCL on CUDA, a torch that has the ops), ``"off"`` never."""
    tp = dist.get_world_size(group)
    spec = model.spec
    if spec.num_kv_heads % tp or spec.vocab_size % tp:
        raise ValueError(f"tp={tp} must divide num_key_value_heads={spec.num_kv_heads} and "
                         f"vocab_size={spec.vocab_size}")
    device = next(model.parameters()).device
    async_tp = use_symm_mem(tp_overlap, group, sequence_parallel, model.backend, device)
    common = dict(tp_group=group, sequence_parallel=sequence_parallel)
    for layer in model.layers.values():
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            if norm is not None:
                _mark_partial(norm.weight)
        if model.backend.name == "te":
            _apply_te_tensor_parallel(model, layer, group, sequence_parallel)
            continue
        for column in (layer.self_attn.qkv, layer.mlp.gate_up):
            if type(column) is not NormLinear:
                raise TypeError(f"tensor parallelism supports the bf16/native layers, got {type(column).__name__}")
            column.weight = _shard(column.weight, 0, group, column.out_parts)
            if column.bias is not None:
                column.bias = _shard(column.bias, 0, group, column.out_parts)
            gathers = async_tp or (sequence_parallel and column.matmul is F.linear)
            _become(column, ColumnParallelNormLinear, out_parts=tuple(p // tp for p in column.out_parts),
                    async_tp=async_tp, matmul_gathers=gathers, **common)
            if gathers:
                column.matmul = functools.partial(all_gather_linear if async_tp else gather_tokens_linear,
                                                  group=group)
            if sequence_parallel:
                _mark_partial(column.norm_weight)
        for row in (layer.self_attn.o_proj, layer.mlp.down):
            row.weight = _shard(row.weight, 1, group)
            _become(row, RowParallelLinear, async_tp=async_tp, **common)
            if async_tp:
                row.matmul = functools.partial(linear_reduce_scatter, group=group)
            if sequence_parallel:
                _mark_partial(row.bias)
    if model.embed_tokens is not None:
        model.embed_tokens.weight = _shard(model.embed_tokens.weight, 0, group)
        _become(model.embed_tokens, VocabParallelEmbedding,
                vocab_start=dist.get_rank(group) * spec.vocab_size // tp, **common)
    if model.lm_head is not None:
        model.lm_head.weight = _shard(model.lm_head.weight, 0, group)
    if model.norm is not None and sequence_parallel:
        _become(model.norm, GatheringRMSNorm, tp_group=group)
        _mark_partial(model.norm.weight)
    _become(model, type(f"TensorParallel{type(model).__name__}", (TensorParallelLogits, type(model)), {}),
            tp_group=group)
