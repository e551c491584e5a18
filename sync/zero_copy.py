"""Zero-copy bucket plans: buckets that are ranges of the storage the trainer's weights already live in.

When every exported tensor is a contiguous view into one storage per dtype (the trainer's flat compute buffer of
``redline.trainer.mixed_precision``), ``plan_in_place`` cuts each storage into byte ranges of at most
``bucket_bytes`` (a tensor larger than that gets a range of its own) and returns the plan together with the flat
``uint8`` views of those ranges, for ``WeightSender.sync_flat``: nothing is packed, the receiver copies straight
out of the trainer's storage. Unlike ``plan_buckets``' layout, a range may hold gaps (the storage's alignment
padding, read by neither side's copy and left out of both sides' checksums) and a layer's tensors may straddle two
ranges, so such plans are for redline's receivers (``TargetLoader``), not SGLang's ``FlattenedTensorBucket``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from redline.sync.plan import BucketLayout, TensorMeta, WeightPlan

ALIGN_BYTES = 8  # a range starts 8-byte aligned (the checksum's words), as every parameter view of the storage does


def plan_in_place(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                  ) -> tuple[WeightPlan, list[torch.Tensor]] | None:
    """``(plan, flat ranges)`` over the storages of ``named_tensors`` (an HF export of views), or None when they
    do not live in one storage per dtype (separate parameter storages, copies, non-contiguous or overlapping
    views, misaligned offsets). A name whose tensor is the same view as an earlier one (a tied ``lm_head``) is
    recorded as an alias of it."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    storages: dict[int, tuple[torch.UntypedStorage, torch.dtype, list]] = {}
    first_name: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in named_tensors:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        if not tensor.is_contiguous():
            return None
        storage = tensor.untyped_storage()
        _, dtype, members = storages.setdefault(storage.data_ptr(), (storage, tensor.dtype, []))
        if dtype != tensor.dtype:
            return None
        members.append((tensor.data_ptr() - storage.data_ptr(), name, tensor))
    if not storages or len({dtype for _, dtype, _ in storages.values()}) != len(storages):
        return None
    buckets: list[BucketLayout] = []
    flats: list[torch.Tensor] = []
    for storage, dtype, members in storages.values():
        members.sort(key=lambda m: m[0])
        ranges, end = [], 0
        for offset, name, tensor in members:
            nbytes = tensor.numel() * tensor.element_size()
            if offset < end:
                return None  # overlapping views: not one parameter per byte
            if not ranges or offset + nbytes - ranges[-1][0] > bucket_bytes:
                if offset % ALIGN_BYTES:
                    return None
                ranges.append((offset, []))
            start, metas = ranges[-1]
            metas.append(TensorMeta(name, tuple(tensor.shape), dtype, offset - start, offset - start + nbytes))
            end = offset + nbytes
        for start, metas in ranges:
            layout = BucketLayout(len(buckets), dtype, tuple(metas))
            buckets.append(layout)
            flats.append(torch.empty(0, dtype=torch.uint8, device=members[0][2].device)
                         .set_(storage, start, (layout.nbytes,)))
    return WeightPlan(tuple(buckets), aliases), flats
