"""HF-named weight loading into a ``redline.trainer.models`` decoder, and releasing/resuming its memory.

The name table is the trainer's own (``hf_entries``): fused tensors (QKV, gate/up) receive each HF tensor in
their dim-0 slice, so a sync bucket in HF names loads without any conversion on the sending side.

Memory: each parameter storage is released and resumed on its own (``release`` / ``resume``), so a sync's loads
allocate bucket by bucket. With ``flat=True`` every parameter is first made a view into one storage per dtype
(``flatten_parameters``), so that a release frees one allocation and a resume makes one — a few hundred
``cudaFree`` / ``cudaMalloc`` calls fewer per colocated step at 8B (each ``cudaFree`` synchronises the device).

Sharing (``share``): the parameters become views of memory the loader does not own — the trainer's flat compute
buffer, mapped into the engine's process — so a colocated sync moves no bytes. Release and resume then leave them
alone; ``unshare`` (and any ``load``) gives the engine its own copy again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from redline.trainer.models.export import hf_entries

# HF checkpoints of tied models may carry lm_head.weight as a copy of the embedding; HF ignores it too.
_TIED_ALIAS = "lm_head.weight"


ALIGN_BYTES = 256  # each parameter's offset in a flat storage: what a separate allocation would have been aligned to


def flatten_parameters(model) -> None:
    """Make every parameter of ``model`` a view into one contiguous storage per (dtype, device), contents kept.

    Needs room for one more copy of the parameters while it runs (the old storages go as each one is copied)."""
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        groups.setdefault((param.dtype, param.device), []).append(param)
    for (dtype, device), params in groups.items():
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += -(-param.numel() // align) * align
        flat = torch.empty(total, dtype=dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(params, offsets):
                view = flat[offset:offset + param.numel()].view(param.shape)
                view.copy_(param.data)
                param.data = view
    if any(device.type == "cuda" for _, device in groups):
        torch.cuda.empty_cache()  # the per-parameter storages, cached by the allocator until now


class WeightLoader:
    def __init__(self, model, flat: bool = False):
        if flat:
            flatten_parameters(model)
        self.model = model
        self.tied = model.lm_head is None
        self.slices: dict[str, tuple[torch.Tensor, int, int]] = {}  # HF name -> (tensor, dim-0 offset, size)
        for names, tensor, parts in hf_entries(model):
            offset = 0
            for name, size in zip(names, parts):
                self.slices[name] = (tensor, offset, size)
                offset += size
        self.shared = False  # whether the parameters are views of memory given to ``share``
        self._own_storages()

    def _own_storages(self) -> None:
        # every parameter storage, keyed by its address when taken (a storage keeps its identity across
        # release/resume, its address does not), and the storage behind each HF name
        params = self.model.parameters()
        self._storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in params}
        self._storage_of = {name: tensor.untyped_storage().data_ptr() for name, (tensor, _, _) in self.slices.items()}
        self._released: dict[int, int] = {}  # storage key -> its bytes, while released

    @torch.no_grad()
    def share(self, sources: Mapping[str, torch.Tensor]) -> str | None:
        """Make every parameter a view of the memory its HF tensors occupy in ``sources`` (``{hf_name: tensor}``,
        e.g. views of the trainer's flat compute buffer mapped into this process): a fused parameter's parts must
        lie back to back, in order, in one storage, with the parameter's dtype and shapes. The parameters' own
        storages are dropped (freed with the caller's last views of them); release and resume leave shared
        parameters alone. Returns None once every parameter is such a view, or why not, changing nothing. The
        caller owns the ordering: nothing may write ``sources`` while the engine reads them."""
        placed = []
        for tensor, names, offsets in self._parameters():
            first = sources.get(names[0])
            if first is None:
                return f"no source tensor for {names[0]!r}"
            storage = first.untyped_storage()
            start = first.data_ptr() - storage.data_ptr()
            # shapes only: a released parameter has no memory to make views of
            row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
            for name, offset in zip(names, offsets):
                source = sources.get(name)
                if source is None:
                    return f"no source tensor for {name!r}"
                part = [self.slices[name][2], *tensor.shape[1:]]
                if source.dtype != tensor.dtype or list(source.shape) != part or not source.is_contiguous():
                    return (f"{name!r}: the source is {source.dtype}{list(source.shape)}, the engine's "
                            f"{tensor.dtype}{part}")
                if (source.untyped_storage().data_ptr() != storage.data_ptr()
                        or source.data_ptr() != first.data_ptr() + offset * row_bytes):
                    return f"{name!r} does not follow {names[0]!r} in one storage, as the engine's fused tensor needs"
            if start % tensor.element_size() or start + tensor.numel() * tensor.element_size() > storage.nbytes():
                return f"{names[0]!r} is not an aligned range of its source storage"
            placed.append((tensor, storage, start))
        for tensor, storage, start in placed:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
                storage, start // tensor.element_size(), tensor.shape)
        self._storages, self._storage_of, self._released = {}, {}, {}
        self.shared = True
        return None

    def unshare(self) -> None:
        """Give the parameters their own storage again (a copy of what they view: needs room for it)."""
        if not self.shared:
            return
        flatten_parameters(self.model)
        self.shared = False
        self._own_storages()

    def _parameters(self):
        """``(tensor, hf_names, dim-0 offsets)`` per parameter, its parts in order."""
        parts: dict[int, tuple[torch.Tensor, list[str], list[int]]] = {}
        for name, (tensor, offset, _) in self.slices.items():
            entry = parts.setdefault(id(tensor), (tensor, [], []))
            entry[1].append(name)
            entry[2].append(offset)
        for tensor, names, offsets in parts.values():
            order = sorted(range(len(names)), key=offsets.__getitem__)
            yield tensor, [names[i] for i in order], [offsets[i] for i in order]

    @torch.no_grad()
    def load(self, named_tensors, wait: bool = True) -> None:
        """Copy each ``(hf_name, tensor)`` into place (any device / dtype; cast on copy). Unknown names or
        shapes raise before anything of the offending tensor is written. ``wait``: return only once the copies
        have landed (a CUDA-IPC sender reuses its buffers when we return); a receiver whose later work is
        stream-ordered after the copies (the broadcast path) passes False."""
        named_tensors = list(named_tensors)
        self.unshare()  # never write through to memory the engine only borrows
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
        """Free parameter memory, keeping the tensors (and their storages) for ``resume``; shared parameters are
        not the engine's to free."""
        for key, storage in self._storages.items():
            if storage.nbytes():
                self._released[key] = storage.nbytes()
                storage.resize_(0)

    def resume(self, names: Iterable[str] | None = None) -> None:
        """Re-allocate released parameter memory (contents undefined until loaded): all of it, or only the
        storages behind the HF ``names``. ``load`` resumes what it writes, so a sync allocates bucket k+1 on the
        host while the device still copies bucket k."""
        keys = list(self._released) if names is None else {self._storage_of[n] for n in names if n in self._storage_of}
        for key in keys:
            nbytes = self._released.pop(key, None)
            if nbytes is not None:
                self._storages[key].resize_(nbytes)
