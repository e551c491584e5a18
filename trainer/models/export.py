"""HF layout of a decoder: which model tensor holds which HF tensor(s), export and save.

One table (``hf_entries``) maps each model tensor to the HF tensor(s) it holds; fused tensors (QKV, gate/up)
list several HF names and are split/concatenated along dim 0. Export, saving and loading all read it.
"""

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30


def hf_entries(model) -> Iterator[tuple[tuple[str, ...], torch.Tensor, tuple[int, ...]]]:
    """``(hf_names, tensor, parts)`` for every tensor the model (stage) holds, each layer's entries together.

    ``parts`` are the dim-0 sizes of ``hf_names`` inside ``tensor`` (full, unsharded sizes).
    """
    spec = model.spec
    if model.embed_tokens is not None:
        yield ("model.embed_tokens.weight",), model.embed_tokens.weight, (spec.vocab_size,)
    qkv_parts = (spec.q_dim, spec.kv_dim, spec.kv_dim)
    mlp_parts = (spec.intermediate_size, spec.intermediate_size)
    for index, layer in model.layers.items():
        prefix = f"model.layers.{index}."
        attn, mlp = layer.self_attn, layer.mlp
        yield (prefix + "input_layernorm.weight",), attn.qkv.norm_weight, (spec.hidden_size,)
        for kind in ("weight", "bias"):
            tensor = optional_param(attn.qkv, kind)
            if tensor is not None:
                yield tuple(f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"), tensor, qkv_parts
        if attn.q_norm is not None:
            yield (prefix + "self_attn.q_norm.weight",), attn.q_norm.weight, (spec.head_dim,)
            yield (prefix + "self_attn.k_norm.weight",), attn.k_norm.weight, (spec.head_dim,)
        yield from _linear_entries(prefix + "self_attn.o_proj", attn.o_proj, spec.hidden_size)
        yield (prefix + "post_attention_layernorm.weight",), mlp.gate_up.norm_weight, (spec.hidden_size,)
        for kind in ("weight", "bias"):
            tensor = optional_param(mlp.gate_up, kind)
            if tensor is not None:
                yield (f"{prefix}mlp.gate_proj.{kind}", f"{prefix}mlp.up_proj.{kind}"), tensor, mlp_parts
        yield from _linear_entries(prefix + "mlp.down_proj", mlp.down, spec.hidden_size)
    if model.norm is not None:
        yield ("model.norm.weight",), model.norm.weight, (spec.hidden_size,)
    if model.lm_head is not None and not spec.tie_word_embeddings:
        yield ("lm_head.weight",), model.lm_head.weight, (spec.vocab_size,)


def optional_param(module, kind):
    """``module.weight`` / ``module.bias``, None when absent (TE keeps an empty tensor for no bias)."""
    tensor = getattr(module, kind, None)
    return tensor if tensor is not None and tensor.numel() > 0 else None


def _linear_entries(name, module, out_features):
    yield (name + ".weight",), module.weight, (out_features,)
    bias = optional_param(module, "bias")
    if bias is not None:
        yield (name + ".bias",), bias, (out_features,)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor: gathered over tensor parallelism when ``redline.trainer.parallel`` sharded it."""
    shard = getattr(tensor, "tp_shard", None)
    return shard.gather(tensor.detach()) if shard is not None else tensor.detach()


def full_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape ``full_tensor`` returns, without gathering."""
    shard = getattr(tensor, "tp_shard", None)
    return shard.full_shape(tensor) if shard is not None else tensor.shape


def _full_entries(model, *, stage_only: bool = False):
    """``(hf_names, full tensor, parts)``: this stage's entries, or under PP (unless ``stage_only``) every
    stage's, broadcast over the pipeline group in stage order."""
    entries = list(hf_entries(model))
    state = getattr(model, "pp_state", None)
    if state is None or stage_only:
        for names, tensor, parts in entries:
            yield names, full_tensor(tensor), parts
        return
    from redline.trainer.parallel.pipeline import broadcast_stages  # parallel imports this module

    announced = [((names, parts), full_shape(tensor), tensor.dtype) for names, tensor, parts in entries]
    device = next(model.parameters()).device
    for (names, parts), tensor in broadcast_stages(announced, (full_tensor(t) for _, t, _ in entries), state,
                                                   device):
        yield names, tensor, parts


@torch.no_grad()
def export_hf(model, *, stage_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` in HF naming and layout: full (TP-gathered) tensors, each layer's together.

    Tied embeddings export only ``model.embed_tokens.weight``, as HF checkpoints do. Under TP every rank must
    iterate (the gathers are collectives). Under PP every stage yields the whole model, in the unsplit model's
    order: each stage's tensors are broadcast over the pipeline group, so every rank must iterate to the end.
    ``stage_only=True`` yields just this stage's tensors with no pipeline communication (a per-stage consumer,
    such as a weight sync sending from each stage's rank 0); without PP it is the whole model too.
    """
    for names, tensor, parts in _full_entries(model, stage_only=stage_only):
        yield from zip(names, tensor.split(parts, dim=0))


def save_pretrained(model, directory: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    write: bool | None = None) -> None:
    """Write ``config.json`` and safetensors shards (+ index when more than one) that ``transformers`` loads.

    Tensors stream from ``export_hf`` into shards of at most ``max_shard_bytes``, each written as soon as it is
    full. Under TP/PP call it on every rank (the gathers are collectives); one rank writes the whole model:
    ``write=None`` means global rank 0 (or the only process), ``write=True/False`` decides for this rank.
    """
    if write is None:
        write = not dist.is_initialized() or dist.get_rank() == 0
    directory = Path(directory)
    if write:
        directory.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str], int]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush():
        partial = directory / f"partial-{len(written):05d}.safetensors"
        save_file(shard, partial, metadata={"format": "pt"})
        written.append((partial, list(shard), shard_bytes))
        shard.clear()

    for name, tensor in export_hf(model):
        if name == "model.embed_tokens.weight":  # the checkpoint's dtype; under PP not this stage's to read
            dtype = tensor.dtype
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
            shard_bytes = 0
        if write:
            shard[name] = tensor.contiguous().cpu()
        shard_bytes += size
    if not write:
        return
    flush()
    config = copy.deepcopy(model.hf_config)
    config.dtype = dtype
    config.save_pretrained(directory)
    if len(written) == 1:
        written[0][0].rename(directory / SAFE_SINGLE)
        return
    weight_map = {}
    for number, (partial, names, _) in enumerate(written, start=1):
        file = f"model-{number:05d}-of-{len(written):05d}.safetensors"
        partial.rename(directory / file)
        weight_map.update({name: file for name in names})
    index = {"metadata": {"total_size": sum(size for _, _, size in written)}, "weight_map": weight_map}
    (directory / SAFE_INDEX).write_text(json.dumps(index, indent=2) + os.linesep)
