"""The embedded engine's side of the colocated weight sync (``redline.sync.protocol``).

``EngineTargets`` is a ``TargetLoader`` over the engine's parameters in HF names (a fused QKV or gate/up
parameter receives each HF tensor in its dim-0 slice): each bucket is one fused copy + checksum launch
(``redline.sync.bucket_copy``), written while the engine's lock is held; parameters the engine released are
allocated as their bucket arrives (``WeightLoader.resume``), so the allocation of bucket k+1 overlaps the device
copy of bucket k. ``serve_weights`` runs the protocol's receiver loop in a thread of the engine process
(``redline.rollout.embedded.process``): persistent staging slots mapped once, done fences, checksums compared by
the trainer. The in-process engine's staged push (``redline.loop.weight_sync``) calls ``load_bucket`` directly.
"""

from __future__ import annotations

import threading

import torch
from redline.devices import device_scope
from redline.sync.plan import BucketLayout, WeightPlan
from redline.sync.receiver import TargetLoader, make_transport, receive_forever


class EngineTargets(TargetLoader):
    """``engine``: an ``EmbeddedEngine``. Strict: a bucket naming a tensor the engine lacks fails the sync.

    ``share(flats, plan)``: the engine's parameters become views of the sender's flat buckets (the trainer's
    compute buffer; ``WeightLoader.share``), so later syncs of those buffers only checksum them in place
    (``TargetLoader.load_bucket`` skips targets that are their own source); ``unshare`` gives the engine its own
    copy back."""

    def __init__(self, engine):
        super().__init__(self._slice_views(engine.weights), prepare=engine.weights.resume)
        self.engine = engine
        self._shared_with = None  # (plan, the flats' addresses, [(parameter, its address)]) once shared

    @staticmethod
    def _slice_views(loader) -> dict[str, torch.Tensor]:
        return {name: tensor.narrow(0, offset, size) for name, (tensor, offset, size) in loader.slices.items()}

    def share(self, flats: list[torch.Tensor], plan: WeightPlan) -> str | None:
        """Take the plan's buckets in ``flats`` (flat uint8, bucket i in ``flats[i]``) as the engine's weights,
        or say why they cannot be (nothing changed then)."""
        addresses = [(flat.data_ptr(), flat.numel()) for flat in flats]
        with self.engine.loading_weights() as weights:
            if self._still_shared(plan, addresses):  # every push after the first: an identity check only
                return None
            sources = {name: view for layout, flat in zip(plan.buckets, flats) for name, view in layout.views(flat)}
            params = list(self.engine.model.parameters())
            before = [p.data_ptr() for p in params]
            reason = weights.share(sources)
            if reason is None:
                if before != [p.data_ptr() for p in params]:
                    self._moved()
                self._shared_with = (plan, addresses, [(p, p.data_ptr()) for p in params])
        return reason

    def _still_shared(self, plan: WeightPlan, addresses: list[tuple[int, int]]) -> bool:
        """The parameters are still the views ``share`` made of these very buffers under this plan."""
        if self._shared_with is None or not self.engine.weights.shared:
            return False
        shared_plan, shared_addresses, params = self._shared_with
        return (shared_plan is plan or shared_plan == plan) and shared_addresses == addresses and all(
            p.data_ptr() == address for p, address in params)

    def unshare(self) -> None:
        """The engine's own copy of what it shares (``WeightLoader.unshare``); our views of the shared buffers go
        too, also where a load already gave the engine its own copy. Nothing to do, and no lock taken (the weights
        may be released), where nothing was shared."""
        if self._shared_with is None and not self.engine.weights.shared:
            return
        with self.engine.between_steps():
            self._shared_with = None
            if self.engine.weights.shared:
                self.engine.weights.unshare()
            self._moved()

    def _moved(self) -> None:
        """The parameters have new addresses: the engine's captured decode graph and our views are stale (made
        again at the next load). Our views were the last references to the storages the parameters left: their
        memory goes back to the GPU."""
        self.engine.weights_moved()
        self.targets = {}
        self._resolved.clear()
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def load_bucket(self, flat: torch.Tensor, layout: BucketLayout, acc: torch.Tensor, row_stride: int = 1) -> None:
        with self.engine.loading_weights():
            self._view_parameters()
            super().load_bucket(flat, layout, acc, row_stride)

    def __call__(self, views) -> None:
        with self.engine.loading_weights():
            self._view_parameters()
            super().__call__(views)

    def _view_parameters(self) -> None:
        """Our views of the parameters, made again after they moved (not before: released, they have no memory)."""
        if not self.targets:
            self.targets = self._slice_views(self.engine.weights)

    def publish_version(self, version: str) -> None:
        """The weight version a sync carries (``WeightSender.sync``'s ``version``), set once its buckets are in."""
        self.engine.weight_version = str(version)


def transport_kind(device: torch.device) -> str:
    """The protocol's transport between two processes on ``device``: CUDA IPC on a GPU, shared memory on the CPU."""
    return "cuda-ipc" if device.type == "cuda" else "shm"


def serve_weights(engine, conn) -> threading.Thread:
    """Serve the trainer's sync sessions on ``conn`` into ``engine`` from a daemon thread, until the trainer
    closes the channel (``WeightSender.close``)."""
    transport = make_transport(transport_kind(engine.device), engine.device)

    def run():
        with device_scope(engine.device):
            receive_forever(conn, transport, EngineTargets(engine))

    thread = threading.Thread(target=run, daemon=True, name="embedded-engine-weights")
    thread.start()
    return thread
