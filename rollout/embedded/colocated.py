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
from redline.sync.plan import BucketLayout
from redline.sync.receiver import TargetLoader, make_transport, receive_forever


class EngineTargets(TargetLoader):
    """``engine``: an ``EmbeddedEngine``. Strict: a bucket naming a tensor the engine lacks fails the sync."""

    def __init__(self, engine):
        loader = engine.weights
        targets = {name: tensor.narrow(0, offset, size) for name, (tensor, offset, size) in loader.slices.items()}
        super().__init__(targets, prepare=loader.resume)
        self.engine = engine

    def load_bucket(self, flat: torch.Tensor, layout: BucketLayout, acc: torch.Tensor, row_stride: int = 1) -> None:
        with self.engine.loading_weights():
            super().load_bucket(flat, layout, acc, row_stride)

    def __call__(self, views) -> None:
        with self.engine.loading_weights():
            super().__call__(views)

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
