"""Receivers: what an engine process does with the buckets the protocol hands it.

``TargetLoader`` applies buckets to a ``{hf_name: tensor}`` target by copying (the embedded engine's process
uses it with its parameters; the tests use it with shared-memory tensors). ``receive_forever`` is the body of a
receiver process: it serves sync sessions on a connection until the trainer closes it; ``target_process`` is
a whole receiver process owning its own ``{hf_name: tensor}`` weights (tests and benchmarks use it as the
engine stand-in; the embedded engine process serves its real parameters with ``receive_forever``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from redline.sync.bucket_copy import BucketCopier
from redline.sync.plan import BucketLayout
from redline.sync.protocol import NamedViews, layout_spans, serve
from redline.sync.transport import CudaIpcTransport, SharedMemoryTransport, Transport


class TargetLoader:
    """``load`` callable for ``serve``: copy each ``(name, view)`` into ``targets[name]``.

    ``serve`` calls ``load_bucket``: one fused launch per bucket copies the slot into the targets and
    accumulates the bucket's checksum in the same pass (``redline.sync.bucket_copy``; targets are resolved
    once per bucket layout and re-checked by identity, so their addresses may change between syncs, e.g. after
    an engine released and resumed its weights). Calling the loader with ``[(name, view)]`` copies with one
    ``_foreach_copy_``. Copies are queued on the current stream; the protocol makes the sender wait for them
    before it reuses the slot. ``strict``: a name the target lacks raises KeyError
    (naming it); otherwise such names are skipped and counted in ``skipped``. Shape or dtype disagreement
    always raises ValueError naming the tensor. ``loaded`` collects the names written since the last
    ``reset``. ``aliases`` (``{name: source}``) are target tensors that mirror another one, e.g. a separate
    ``lm_head.weight`` of a model with tied embeddings, which the plan does not send: they are copied from
    their source whenever it arrives (nothing is done when both names share storage). ``prepare(names)`` runs
    before a bucket's tensors are written: an engine whose weights were released allocates them there
    (``WeightLoader.resume``), overlapping the copy of the previous bucket.
    """

    def __init__(self, targets: Mapping[str, torch.Tensor], *, strict: bool = True,
                 aliases: Mapping[str, str] | None = None, copier: BucketCopier | None = None,
                 prepare: Callable[[list[str]], None] | None = None):
        self.targets = targets
        self.prepare = prepare
        self.strict = strict
        self.copier = copier or BucketCopier()
        self._resolved: dict[int, tuple] = {}  # layout index -> (layout, targets, mirrors, names, skipped)
        self.mirrors: dict[str, list[str]] = {}
        for alias, source in (aliases or {}).items():
            if alias in targets and source in targets and not _same_storage(targets[alias], targets[source]):
                self.mirrors.setdefault(source, []).append(alias)
        self.loaded: set[str] = set()
        self.skipped: set[str] = set()

    def reset(self) -> None:
        self.loaded.clear()
        self.skipped.clear()

    @torch.no_grad()  # targets may be parameters (an engine's weights) or views of them
    def __call__(self, views: NamedViews) -> None:
        views = list(views)
        if self.prepare is not None:
            self.prepare([name for name, _ in views])
        dsts, srcs = [], []
        for name, view in views:
            target = self._target(name, view.shape, view.dtype)
            if target is None:
                self.skipped.add(name)
                continue
            dsts.append(target)
            srcs.append(view)
            self.loaded.add(name)
            for alias in self.mirrors.get(name, ()):
                dsts.append(self.targets[alias])
                srcs.append(view)
                self.loaded.add(alias)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    @torch.no_grad()
    def load_bucket(self, flat: torch.Tensor, layout: BucketLayout, acc: torch.Tensor, row_stride: int = 1) -> None:
        """Copy bucket ``layout`` out of the flat uint8 ``flat`` into the targets and add the bucket's checksum
        (of all its bytes, loaded or skipped) to ``acc`` (``[LANES, 2]`` int64), in one pass. A target that is a
        view of its own bytes in ``flat`` (weights shared with the sender) is only checksummed."""
        if self.prepare is not None:
            self.prepare(layout.names)
        targets, mirrors = self._resolve(layout)
        spans = layout_spans(layout)
        base = flat.data_ptr()  # a target that is its own source (shared weights) is checksummed, not copied
        targets = [None if t is not None and t.data_ptr() == base + start else t for t, (start, _) in zip(targets, spans)]
        self.copier.unpack(flat, layout.nbytes, spans, targets, acc, row_stride)
        if mirrors:
            torch._foreach_copy_([a for a, _ in mirrors], [s for _, s in mirrors])

    def _resolve(self, layout: BucketLayout):
        """The target (or None, skipped) of each tensor of ``layout`` and the mirror copies; checked once per
        layout, then by identity of the mapping's tensors."""
        cached = self._resolved.get(layout.index)
        if cached is not None and (cached[0] is layout or cached[0] == layout) and all(
                (self.targets.get(m.name) is t) for m, t in zip(layout.tensors, cached[1])):
            _, targets, mirrors, names, skipped = cached
        else:
            targets, mirrors, names, skipped = [], [], [], []
            for meta in layout.tensors:
                target = self._target(meta.name, meta.shape, meta.dtype)
                targets.append(target)
                if target is None:
                    skipped.append(meta.name)
                    continue
                names.append(meta.name)
                for alias in self.mirrors.get(meta.name, ()):
                    mirrors.append((self.targets[alias], target))
                    names.append(alias)
            self._resolved[layout.index] = (layout, targets, mirrors, names, skipped)
        self.loaded.update(names)
        self.skipped.update(skipped)
        return targets, mirrors

    def _target(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """``targets[name]``, checked against the bucket's ``shape`` and ``dtype``; None for a name the receiver
        lacks when not ``strict`` (the caller counts it as skipped)."""
        target = self.targets.get(name)
        if target is None:
            if self.strict:
                raise KeyError(f"the receiver has no tensor named {name!r} (it has {len(self.targets)} "
                               "tensors; is the export's naming the engine's HF naming?)")
            return None
        if target.shape != shape or target.dtype != dtype:
            raise ValueError(f"{name!r}: the receiver's tensor is {target.dtype}{list(target.shape)}, the "
                             f"bucket carries {dtype}{list(shape)}")
        return target


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def make_transport(kind: str, device: torch.device | int | str | None = None) -> Transport:
    """``"cuda-ipc"`` or ``"shm"`` (CPU shared memory) by name, for process entry points."""
    if kind == "cuda-ipc":
        return CudaIpcTransport(device)
    if kind == "shm":
        return SharedMemoryTransport()
    raise ValueError(f"unknown transport {kind!r}; expected 'cuda-ipc' or 'shm'")


def receive_forever(conn, transport: Transport, load: Callable[[NamedViews], None]) -> None:
    """Serve syncs into ``load`` until the sender closes ``conn``; then close it on this side too."""
    try:
        serve(conn, transport, load)
    finally:
        conn.close()


def target_process(conn, specs, transport: str = "cuda-ipc", share_targets: bool = False,
                   aliases: Mapping[str, str] | None = None) -> None:
    """Process entry: allocate zero weights for ``specs`` (``[(name, shape, dtype)]``) on the transport's device
    and serve syncs into them. With ``share_targets`` the weights are first sent over ``conn`` as a dict (CUDA
    IPC / shared memory handles) so the trainer process can read them or copy into them directly."""
    transport_impl = make_transport(transport)
    targets = {name: torch.zeros(shape, dtype=dtype, device=transport_impl.device) for name, shape, dtype in specs}
    if share_targets:
        conn.send(targets)
    receive_forever(conn, transport_impl, TargetLoader(targets, aliases=aliases))
