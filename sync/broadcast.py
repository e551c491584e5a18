"""Disaggregated sync: broadcast each flat bucket from the trainer to every engine GPU (sync.md §1.4).

Group: one per pipeline stage, named ``stage_group_name(pp_rank)``, made of that stage's trainer rank 0 (group
rank 0, the only source) and every GPU of every engine (engine ``i`` joins with ``rank_offset`` from
``rank_offsets``). Both sides must build it the way SGLang's ``init_custom_process_group`` does —
rendezvous at ``tcp://addr:port``, then ``PrefixStore(group_name, store)``, then
``_new_process_group_helper`` — otherwise the two sides look up different store keys and both wait out the
timeout without a word (tokenspeed#1373). ``init_weight_update_group`` is that construction.

Per bucket the sender packs into one of ``num_slots`` staging buffers (kept across syncs) and starts an async
broadcast of its bytes; a slot is packed again only after the broadcast that read it completed
(``work.wait()``: a device-side wait for NCCL, so the host keeps packing). Receivers get the bytes into one of
two buffers (kept across syncs) laid out like SGLang's ``FlattenedTensorBucket.empty`` (the plan's layout): the
receive of bucket k+1 is posted before bucket k is loaded, so loading overlaps the next transfer and the link
stays busy. Packing and loading accumulate the bucket checksums in the same pass
(``redline.sync.bucket_copy``).

Check: each side keeps per-bucket checksums on device; after the last bucket (a collective over the group,
run by the sender and by every redline receiver) the sender's checksums are broadcast, each receiver
compares, and a MAX all-reduce of the per-bucket mismatch flags lets every rank raise ``ChecksumMismatch``
naming the buckets. SGLang receivers do not take part; use ``verify=False`` for groups that contain them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import bucket_checksum, fold, new_accumulator
from redline.sync.plan import BucketLayout, WeightPlan, bucketize
from redline.sync.protocol import ChecksumMismatch, NamedViews, SyncReport, layout_spans

DEFAULT_GROUP_TIMEOUT = timedelta(minutes=10)


def stage_group_name(pp_rank: int) -> str:
    return f"redline-weights-pp{pp_rank}"


def rank_offsets(engine_gpus: list[int]) -> tuple[list[int], int]:
    """Group rank of each engine's first GPU, and the group's world size (trainer source = rank 0)."""
    offsets, next_rank = [], 1
    for gpus in engine_gpus:
        if gpus < 1:
            raise ValueError(f"every engine needs at least one GPU, got {engine_gpus}")
        offsets.append(next_rank)
        next_rank += gpus
    return offsets, next_rank


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, backend: str = "nccl",
                             timeout: timedelta = DEFAULT_GROUP_TIMEOUT,
                             high_priority: bool = True) -> dist.ProcessGroup:
    """Join the weight-update group exactly as SGLang's ``init_weights_update_group`` does on the engine side.

    The trainer calls it with ``rank=0``; redline's own engine processes with their ``rank_offset + tp_rank``.
    Works without a default process group. The private c10d helper is what SGLang itself calls; using the
    public ``new_group`` would build the store keys differently and never meet SGLang's side.
    ``high_priority`` (NCCL only; a local setting, the other members need not match): this process's NCCL
    stream gets the device's highest priority, so a transfer that becomes ready while a bucket's pack or load
    kernel (thousands of CTAs) is queued gets SMs first instead of waiting for that kernel to drain.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside the weight-update group of world_size {world_size}")
    # the store ``rendezvous("tcp://addr:port")`` makes, built here: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    # rendezvous makes every rank a client of the launcher's store, so nobody would serve this address
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          multi_tenant=True)
    store = PrefixStore(group_name, store)
    options = None
    if backend == "nccl" and high_priority:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         backend_options=options, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class BroadcastSender:
    """Group rank 0: broadcast every bucket of the plan to the whole group.

    ``announce(layout)`` runs before each bucket's broadcast: for SGLang engines it fires (without waiting) the
    ``/update_weights_from_distributed`` request built by ``redline.sync.sglang.update_from_distributed_body``,
    because SGLang posts its receive only when that request arrives.
    """

    def __init__(self, group: dist.ProcessGroup, plan: WeightPlan, device: torch.device, *, num_slots: int = 2,
                 verify: bool = True, copier: BucketCopier | None = None):
        if group.rank() != 0:
            raise ValueError(f"the broadcast source must be rank 0 of the group, this process is rank "
                             f"{group.rank()}")
        if not plan.buckets:
            raise ValueError("the weight plan has no buckets: nothing to sync")
        self.group, self.plan, self.device, self.verify = group, plan, torch.device(device), verify
        self.num_slots = min(num_slots, len(plan.buckets))
        self.copier = copier or BucketCopier()
        self._slots: list[torch.Tensor] = []
        self._acc = new_accumulator(len(plan.buckets), self.device)

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
             announce: Callable[[BucketLayout], None] | None = None) -> SyncReport:
        start = time.perf_counter()
        if not self._slots:
            self._slots = [torch.empty(self.plan.capacity, dtype=torch.uint8, device=self.device)
                           for _ in range(self.num_slots)]
        acc = self._acc.zero_()
        works = []
        for layout, tensors in bucketize(self.plan, named_tensors):
            slot = self._slots[layout.index % self.num_slots]
            if layout.index >= self.num_slots:
                works[layout.index - self.num_slots].wait()  # the broadcast reading this slot is done
            self.copier.pack(slot, layout.nbytes, layout_spans(layout), tensors, acc[layout.index])
            if announce is not None:
                announce(layout)
            works.append(dist.broadcast(slot[:layout.nbytes], group_src=0, group=self.group, async_op=True))
        for work in works[-self.num_slots:]:
            work.wait()
        if self.verify:
            _compare(self.group, fold(acc), self.plan)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return SyncReport("broadcast", len(works), self.plan.nbytes, time.perf_counter() - start, 0.0)


class BroadcastReceiver:
    """A redline engine GPU in the group: receive every bucket of the plan and ``load`` it.

    ``load`` gets ``[(hf_name, view)]`` per bucket, or, when it has one, its ``load_bucket(flat, layout, acc,
    row_stride)`` is called (``TargetLoader``: copy + checksum in one pass). Keep the receiver for the next
    sync: its two receive buffers are allocated once."""

    def __init__(self, group: dist.ProcessGroup, plan: WeightPlan, device: torch.device, *, verify: bool = True):
        self.group, self.plan, self.device, self.verify = group, plan, torch.device(device), verify
        self._buffers: list[torch.Tensor] = []
        self._acc = new_accumulator(len(plan.buckets), self.device)

    def sync(self, load: Callable[[NamedViews], None]) -> None:
        """Receive and load all buckets; with ``verify``, join the checksum comparison (raises on mismatch)."""
        if not self._buffers:
            self._buffers = [torch.empty(self.plan.capacity, dtype=torch.uint8, device=self.device)
                             for _ in range(min(2, len(self.plan.buckets)))]
        acc = self._acc.zero_()
        fused = getattr(load, "load_bucket", None)
        buckets = self.plan.buckets
        pending = self._post(buckets[0])
        for layout in buckets:
            work, buffer = pending
            if layout.index + 1 < len(buckets):
                # posted before this bucket's load is queued: the transfer of k+1 overlaps the load of k, and
                # its buffer's previous load (k-1) is already queued, so NCCL waits for it
                pending = self._post(buckets[layout.index + 1])
            work.wait()
            if fused is not None:
                fused(buffer, layout, acc[layout.index], 1)
            else:
                load(layout.views(buffer))
                acc[layout.index, 0] += bucket_checksum(buffer, layout.nbytes)
        if self.verify:
            _compare(self.group, fold(acc), self.plan)

    def _post(self, layout: BucketLayout):
        buffer = self._buffers[layout.index % len(self._buffers)]
        return dist.broadcast(buffer[:layout.nbytes], group_src=0, group=self.group, async_op=True), buffer


def _compare(group: dist.ProcessGroup, local: torch.Tensor, plan: WeightPlan) -> None:
    """Collective: every rank learns which buckets some receiver read differently from the sender."""
    reference = local.clone()
    dist.broadcast(reference, group_src=0, group=group)
    mismatch = (reference != local).any(dim=1).to(torch.int32)
    dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=group)
    bad = mismatch.nonzero().flatten().tolist()
    if bad:
        names = [plan.buckets[i].names[:3] for i in bad[:3]]
        raise ChecksumMismatch(f"weight broadcast: some receiver's checksums differ for buckets {bad} "
                               f"(first tensors: {names})")
