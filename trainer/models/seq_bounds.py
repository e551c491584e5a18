"""Host copies of packed-sequence boundaries (``cu_seqlens``), read from the device at most once per tensor.

Attention needs ``cu_seqlens`` on the host (flash and TE for ``max_seqlen``, SDPA per length for every bound),
and a device-to-host read waits for all GPU work queued before it: read in every layer, the GPU runs dry once
per layer while the host catches up. Every layer of a forward (and its recompute) gets the same ``cu_seqlens``
tensor, so the values are kept per tensor object (while it lives and is not modified); whoever built the tensor
from host values records them with ``remember`` and no read happens at all.
"""

import weakref

import torch

_MAX_ENTRIES = 256
_known: dict[int, tuple[weakref.ref, int, list[int]]] = {}  # id(tensor) -> (the tensor, its version, its values)


def remember(cu_seqlens: torch.Tensor, values: list[int]) -> None:
    """Record ``values`` (``cu_seqlens`` as Python ints) as the host copy of ``cu_seqlens``."""
    if len(_known) >= _MAX_ENTRIES:
        for key in [k for k, (ref, _, _) in list(_known.items()) if ref() is None]:
            _known.pop(key, None)
        if len(_known) >= _MAX_ENTRIES:
            _known.clear()
    _known[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, list(values))


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens [S+1]`` as a list of ints: the recorded copy, else one read of the device (then recorded)."""
    entry = _known.get(id(cu_seqlens))
    if entry is not None and entry[0]() is cu_seqlens and entry[1] == cu_seqlens._version:
        return entry[2]
    values = cu_seqlens.tolist()
    remember(cu_seqlens, values)
    return values


def max_length(cu_seqlens: torch.Tensor) -> int:
    """The longest sequence of ``cu_seqlens`` (0 for none), from its host copy."""
    bounds = host_bounds(cu_seqlens)
    return max((end - start for start, end in zip(bounds[:-1], bounds[1:])), default=0)
