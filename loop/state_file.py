"""Trainer state on disk without pickle: tensors in safetensors, everything else in JSON.

``save(path, state)`` writes ``<path>.safetensors`` and ``<path>.json``; ``load(path)`` reads them back. Loading
never unpickles and never runs code from the files, so a checkpoint from elsewhere is data, not a program.

What round-trips (exactly, types included): dicts (keys of any supported hashable type: str, int, ...), lists,
tuples, ``torch.Tensor`` of any dtype and shape (0-dim, bf16, int64, uint8 RNG states ...; saved from any device,
loaded on the CPU), numpy arrays (the numpy RNG state) and numpy scalars, Python ``int``/``float`` (inf and nan
included)/``bool``/``str``/``None``. Anything else raises ``TypeError`` naming where it sits in the state.

The JSON document: ``{"format": "redline-state", "version": 1, "state": <value>}`` where a value is a JSON
``null``/bool/int/float/str as itself, a list as a JSON array, and every other value an object with one tag:
``{"tuple": [...]}``, ``{"dict": {str key: value}}`` (all keys strings) or ``{"items": [[key, value], ...]}``
(any other keys, each key itself a value), ``{"tensor": name}`` (the tensor stored under ``name`` in the
safetensors file), ``{"ndarray": nested lists, "dtype": numpy dtype string}``, ``{"npscalar": number,
"dtype": ...}``.
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT, VERSION = "redline-state", 1


def paths(path: Path) -> tuple[Path, Path]:
    """``(json, safetensors)`` file paths of the state stored at ``path`` (given without a suffix)."""
    path = Path(path)
    return path.with_name(path.name + ".json"), path.with_name(path.name + ".safetensors")


def save(path: Path, state) -> None:
    """Write ``state`` as ``<path>.json`` + ``<path>.safetensors``."""
    tensors: dict[str, torch.Tensor] = {}
    document = {"format": FORMAT, "version": VERSION, "state": _encode(state, tensors, "state")}
    json_path, tensor_path = paths(path)
    # clone: safetensors refuses tensors that share storage (views of one buffer, tied weights)
    save_file({name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}, str(tensor_path))
    json_path.write_text(json.dumps(document))


def load(path: Path):
    """The state saved at ``path`` (tensors on the CPU)."""
    json_path, tensor_path = paths(path)
    document = json.loads(json_path.read_text())
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("version") != VERSION:
        raise ValueError(f"{json_path}: not a {FORMAT} file of version {VERSION}")
    return _decode(document["state"], load_file(str(tensor_path)), str(json_path))


def _encode(value, tensors: dict, where: str):
    if isinstance(value, np.generic):  # before float: np.float64 is a float subclass
        return {"npscalar": value.item(), "dtype": value.dtype.str}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}  # strict JSON has no inf/nan
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value
        return {"tensor": name}
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}}
        return {"items": [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")]
                          for k, v in value.items()]}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} in a checkpoint state file")


def _decode(value, tensors: dict, source: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, tensors, source) for v in value]
    if isinstance(value, dict) and len(value) in (1, 2):
        if "tuple" in value:
            return tuple(_decode(v, tensors, source) for v in value["tuple"])
        if "dict" in value:
            return {k: _decode(v, tensors, source) for k, v in value["dict"].items()}
        if "items" in value:
            try:
                return {_decode(k, tensors, source): _decode(v, tensors, source) for k, v in value["items"]}
            except TypeError as exc:  # a list as a key: the file was not written by save()
                raise ValueError(f"{source}: {exc}") from None
        if "tensor" in value:
            if value["tensor"] not in tensors:
                raise ValueError(f"{source}: tensor {value['tensor']!r} is missing from the safetensors file")
            return tensors[value["tensor"]]
        if "float" in value:
            return float(value["float"])
        if "ndarray" in value:
            return np.array(value["ndarray"], dtype=_numeric_dtype(value["dtype"], source))
        if "npscalar" in value:
            return _numeric_dtype(value["dtype"], source).type(value["npscalar"])
    raise ValueError(f"{source}: unexpected entry {str(value)[:80]!r}")


def _numeric_dtype(name: str, source: str) -> np.dtype:
    dtype = np.dtype(name)
    if dtype.kind not in "biuf":  # bool, int, uint, float: what RNG states hold; never objects
        raise ValueError(f"{source}: numpy dtype {name!r} is not numeric")
    return dtype
