"""Build decoders: random weights from a HF config, or weights from a local HF checkpoint."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from redline.trainer.layers import LayerBackend, layer_backend
from redline.trainer.models.decoder import DecoderModel
from redline.trainer.models.export import SAFE_INDEX, SAFE_SINGLE, hf_entries
from redline.trainer.models.spec import load_hf_config


def _build(config, backend, dtype, device) -> tuple[PretrainedConfig, DecoderModel]:
    hf_config = load_hf_config(config)
    if isinstance(backend, str):
        backend = layer_backend(backend)
    if not isinstance(backend, LayerBackend):
        raise TypeError(f"backend must be a name or a LayerBackend, got {type(backend).__name__}")
    return hf_config, DecoderModel(hf_config, backend, dtype=dtype, device=device)


def _parallelize(model, parallel):
    if parallel is None:
        return model
    from redline.trainer.parallel import parallelize

    return parallelize(model, parallel)


@torch.no_grad()
def init_weights(model: DecoderModel, std: float, generator: torch.Generator) -> None:
    """HF-style random init in HF tensor order: matrices ~ N(0, std), norm weights 1, biases 0.

    Walking the HF table (not ``named_parameters``) makes the weights depend on the seed only, not on the
    backend's parameter order, so a TE model and a bf16 model built with one seed are the same model.
    """
    for names, tensor, _ in hf_entries(model):
        if names[0].endswith(".bias"):
            tensor.zero_()
        elif tensor.dim() == 1:  # every 1-D weight of these families is a norm scale
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, std, generator=generator)


def from_config(hf_config_or_path, *, backend="bf16", parallel=None, dtype=torch.bfloat16, device="cpu",
                seed: int | None = None) -> DecoderModel:
    """A decoder with random weights (``N(0, initializer_range)``, HF's init) from a HF config or directory.

    Under ``parallel`` every rank builds the same full weights (pass ``seed``) and keeps its shard.
    """
    hf_config, model = _build(hf_config_or_path, backend, dtype, device)
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    init_weights(model, getattr(hf_config, "initializer_range", 0.02), generator)
    return _parallelize(model, parallel)


def checkpoint_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file of a local checkpoint directory (sharded with index, or single)."""
    index = path / SAFE_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / SAFE_SINGLE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"{path} holds neither {SAFE_INDEX} nor {SAFE_SINGLE}")


@torch.no_grad()
def load_hf_weights(model: DecoderModel, path: str | Path) -> None:
    """Copy a local HF checkpoint's tensors into an unsharded model; missing or unexpected names raise."""
    path = Path(path)
    files = checkpoint_files(path)
    handles = {}
    used = set()
    for names, tensor, parts in hf_entries(model):
        missing = [n for n in names if n not in files]
        if missing:
            raise KeyError(f"{path}: checkpoint lacks {missing[0]}")
        pieces = []
        for name, size in zip(names, parts):
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt", device=str(tensor.device))
            piece = handles[file].get_tensor(name)
            if piece.shape[0] != size:
                raise ValueError(f"{file}: {name} has shape {tuple(piece.shape)}; the config implies dim 0 "
                                 f"= {size}")
            pieces.append(piece)
            used.add(name)
        tensor.copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding); HF ignores it too.
    unexpected = sorted(set(files) - used - {"lm_head.weight"})
    if unexpected:
        raise ValueError(f"{path}: checkpoint tensors the model has no place for, e.g. {unexpected[:3]}")


def from_pretrained(path: str | Path, *, backend="bf16", parallel=None, dtype=torch.bfloat16,
                    device="cpu") -> DecoderModel:
    """A decoder loaded from a local HF directory (``config.json`` + safetensors, sharded or single)."""
    _, model = _build(path, backend, dtype, device)
    load_hf_weights(model, path)
    return _parallelize(model, parallel)
