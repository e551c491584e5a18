"""Colocated sync into a receiver in the same process (the in-process embedded engine), checked per bucket.

Two ways, chosen by the caller (``redline.loop.weight_sync`` measures both; ``REDLINE_IN_PROCESS_SYNC``):

* **staged** (``LocalSender.sync``): each bucket is packed into one staging slot with its checksum accumulated
  in the same pass, then loaded into the receiver's tensors with the receiver's checksum accumulated in that
  pass (``TargetLoader.load_bucket``): the protocol's two fused copies without the process boundary. One slot
  is enough: pack k+1 is queued after load k on the same stream.
* **direct** (``check_copies`` after the engine copied the export itself, one copy): the receiver's tensors are
  compared with the sent ones, bytes of every ``row_stride``-th row of ``ROW_BYTES`` of each tensor (and its
  last row), one batched comparison per bucket and one host synchronisation per push.

Either raises ``ChecksumMismatch`` naming the buckets that differ.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import ROW_BYTES, fold, new_accumulator
from redline.sync.plan import WeightPlan, bucketize
from redline.sync.protocol import ChecksumMismatch, SyncReport, layout_spans
from redline.sync.receiver import TargetLoader


def mismatch(plan: WeightPlan, bad: list[int], what: str) -> ChecksumMismatch:
    """The error for buckets ``bad`` of ``plan``, naming them and their first tensors."""
    names = {i: plan.buckets[i].names[:3] for i in bad[:3]}
    return ChecksumMismatch(f"weight sync: {what} differ for bucket(s) {bad} of {len(plan.buckets)} "
                            f"(first tensors: {names}); the engine's weights are not the trainer's")


def sampled_rows(tensor: torch.Tensor, row_stride: int) -> torch.Tensor:
    """The bytes of every ``row_stride``-th ``ROW_BYTES`` row of ``tensor`` and of its last row, flat uint8."""
    data = tensor.reshape(-1).view(torch.uint8)
    if row_stride == 1:
        return data
    full = data.numel() // ROW_BYTES
    picked = [data[:full * ROW_BYTES].view(full, ROW_BYTES)[::row_stride].reshape(-1)]
    if data.numel() % ROW_BYTES:  # a partial last row: never among the sampled full rows
        picked.append(data[full * ROW_BYTES:])
    elif full and (full - 1) % row_stride:  # a full last row the stride skipped
        picked.append(data[(full - 1) * ROW_BYTES:])
    return torch.cat(picked)


class LocalSender:
    """``plan``: the bucket plan of the export; ``loader``: the receiver's ``TargetLoader`` (its ``targets``
    are what ``check_copies`` reads); ``device``: where the staging slot lives (the trainer's and the
    receiver's); ``checksum_row_stride``: 1 checks every row, n every n-th and the last."""

    def __init__(self, plan: WeightPlan, loader: TargetLoader, device: torch.device, *, checksum_row_stride: int = 1,
                 copier: BucketCopier | None = None):
        if checksum_row_stride < 1:
            raise ValueError(f"checksum_row_stride must be >= 1, got {checksum_row_stride}")
        self.plan, self.loader, self.device = plan, loader, torch.device(device)
        self.row_stride = checksum_row_stride
        self.copier = copier or BucketCopier()
        self._spans = [layout_spans(b) for b in plan.buckets]
        self._slot: torch.Tensor | None = None
        self._acc: torch.Tensor | None = None

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Pack and load every bucket of the export ``named_tensors``, then compare the two sides' checksums."""
        start = time.perf_counter()
        if self._slot is None:
            self._slot = torch.empty(self.plan.capacity, dtype=torch.uint8, device=self.device)
            self._acc = new_accumulator(2 * len(self.plan.buckets), self.device)
        self._acc.zero_()
        sent, held = self._acc[0::2], self._acc[1::2]
        for layout, tensors in bucketize(self.plan, named_tensors):
            self.copier.pack(self._slot, layout.nbytes, self._spans[layout.index], tensors, sent[layout.index],
                             self.row_stride)
            self.loader.load_bucket(self._slot, layout, held[layout.index], self.row_stride)
        sums = fold(self._acc).view(len(self.plan.buckets), 2, 2)
        bad = (sums[:, 0] != sums[:, 1]).any(dim=1).nonzero().flatten().tolist()  # the one host synchronisation
        if bad:
            raise mismatch(self.plan, bad, "the loaded buckets' checksums")
        return SyncReport("staged", len(self.plan.buckets), self.plan.nbytes, time.perf_counter() - start, 0.0)

    @torch.no_grad()
    def check_copies(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """After the receiver copied the export itself: its tensors must hold the sampled rows' bytes of
        ``named_tensors`` (the same export)."""
        differs = []
        for layout, tensors in bucketize(self.plan, named_tensors):
            held = [self.loader.targets[name] for name in layout.names]
            sent_rows = torch.cat([sampled_rows(t, self.row_stride) for t in tensors])
            held_rows = torch.cat([sampled_rows(t, self.row_stride) for t in held])
            differs.append((sent_rows != held_rows).any())
        bad = torch.stack(differs).nonzero().flatten().tolist()
        if bad:
            raise mismatch(self.plan, bad, "the engine's tensors")

    def release(self) -> None:
        """Free the staging slot (made again by the next ``sync``)."""
        self._slot = self._acc = None
