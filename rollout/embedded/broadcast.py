"""The embedded engine process's side of the disaggregated weight sync (``redline.sync.broadcast``).

The trainer (group rank 0) broadcasts each bucket of its ``WeightPlan``; this process joins the weight-update
group as ``rank`` and loads every bucket into its engine's model (fused QKV / gate-up slices included) through
``EmbeddedEngine.load_weights``, then takes part in the collective checksum check (a mismatch raises
``ChecksumMismatch`` here and on the trainer). NCCL between GPUs, gloo on CPU.

Called by ``redline.rollout.embedded.process`` for the messages in ``METHODS``; each runs in a worker thread of
the process's event loop, so generation requests keep being served meanwhile (the loop syncs only between
rollouts).
"""

from __future__ import annotations

import functools
from datetime import timedelta

from redline.devices import device_scope

METHODS = frozenset({"join_weight_group", "receive_weights", "export_weights", "leave_weight_group"})


class BroadcastWeights:
    """One engine's membership of the weight-update group: a ``BroadcastReceiver`` kept across syncs (its two
    receive buffers are allocated once)."""

    def __init__(self, engine, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, plan, timeout_s: float):
        from redline.sync.broadcast import BroadcastReceiver, init_weight_update_group

        self.engine = engine
        self.device = engine.model.embed_tokens.weight.device
        with device_scope(self.device):
            self.group = init_weight_update_group(master_address, master_port, rank, world_size, group_name,
                                                  backend=backend, timeout=timedelta(seconds=timeout_s))
            try:
                self.receiver = BroadcastReceiver(self.group, plan, self.device)
            except BaseException:
                self.close()
                raise

    def receive(self, version: str) -> None:
        # no host wait per bucket: the next receive into a buffer is stream-ordered after that buffer's load
        with device_scope(self.device):
            self.receiver.sync(functools.partial(self.engine.load_weights, wait=False))
        self.engine.weight_version = str(version)

    def close(self) -> None:
        import torch.distributed as dist

        with device_scope(self.device):
            dist.destroy_process_group(self.group)


_members: dict[int, BroadcastWeights] = {}  # id(engine) -> its membership (one engine per process in practice)


def handle(engine, method: str, args: tuple):
    """Run one of ``METHODS`` for ``engine`` (blocking; the process calls it in a worker thread)."""
    if method == "join_weight_group":
        if id(engine) in _members:
            raise RuntimeError("this engine already joined a weight-update group")
        _members[id(engine)] = BroadcastWeights(engine, *args)
        return None
    if method == "export_weights":  # the engine's weights in HF names, on the CPU (tests compare them)
        return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in engine.model.export_hf()]
    member = _members.get(id(engine))
    if member is None:
        raise RuntimeError(f"{method}: the engine has not joined a weight-update group (join_weight_group)")
    if method == "receive_weights":
        return member.receive(*args)
    if method == "leave_weight_group":
        _members.pop(id(engine)).close()
        return None
    raise ValueError(f"unknown broadcast method {method!r}")

