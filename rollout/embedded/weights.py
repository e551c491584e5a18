"""HF-named weight loading into a ``redline.trainer.models`` decoder, and releasing/resuming its memory.

The name table is the trainer's own (``hf_entries``): fused tensors (QKV, gate/up) receive each HF tensor in
their dim-0 slice, so a sync bucket in HF names loads without any conversion on the sending side.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from redline.trainer.models.export import hf_entries

# HF checkpoints of tied models may carry lm_head.weight as a copy of the embedding; HF ignores it too.
_TIED_ALIAS = "lm_head.weight"


class WeightLoader:
    def __init__(self, model):
        self.model = model
        self.tied = model.lm_head is None
        self.slices: dict[str, tuple[torch.Tensor, int, int]] = {}  # HF name -> (tensor, dim-0 offset, size)
        for names, tensor, parts in hf_entries(model):
            offset = 0
            for name, size in zip(names, parts):
                self.slices[name] = (tensor, offset, size)
                offset += size
        self._released: dict[int, tuple[torch.UntypedStorage, int]] = {}  # storage id -> (storage, bytes)

    @torch.no_grad()
    def load(self, named_tensors, wait: bool = True) -> None:
        """Copy each ``(hf_name, tensor)`` into place (any device / dtype; cast on copy). Unknown names or
        shapes raise before anything of the offending tensor is written. ``wait``: return only once the copies
        have landed (a CUDA-IPC sender reuses its buffers when we return); a receiver whose later work is
        stream-ordered after the copies (the broadcast path) passes False."""
        named_tensors = list(named_tensors)
        if self._released:
            self.resume(name for name, _ in named_tensors)
        for name, value in named_tensors:
            if name == _TIED_ALIAS and self.tied:
                continue
            if name not in self.slices:
                raise KeyError(f"load_weights: the model has no parameter for HF tensor '{name}'")
            tensor, offset, size = self.slices[name]
            target = tensor.narrow(0, offset, size)
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"load_weights: '{name}' has shape {tuple(value.shape)}, the model expects "
                                 f"{tuple(target.shape)}")
            target.copy_(value)
        if wait and self.model.embed_tokens.weight.is_cuda:
            torch.cuda.synchronize(self.model.embed_tokens.weight.device)

    def release(self) -> None:
        """Free parameter memory, keeping the tensors (and their storages) for ``resume``."""
        for param in self.model.parameters():
            storage = param.untyped_storage()
            if storage.nbytes():
                self._released[storage._cdata] = (storage, storage.nbytes())
                storage.resize_(0)

    def resume(self, names: Iterable[str] | None = None) -> None:
        """Re-allocate released parameter memory (contents undefined until loaded): all of it, or only the
        storages behind the HF ``names``. ``load`` resumes what it writes, so a sync allocates bucket k+1 on the
        host while the device still copies bucket k."""
        if names is None:
            keys = list(self._released)
        else:
            keys = {self.slices[n][0].untyped_storage()._cdata for n in names if n in self.slices}
        for key in keys:
            entry = self._released.pop(key, None)
            if entry is not None:
                entry[0].resize_(entry[1])
