"""SGLang as a receiver: flattened-bucket payloads and the version-gated request bodies (sync.md §1).

Colocated (``update_weights_from_tensor``, ``load_format="flattened_bucket"``): each bucket becomes
``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}`` serialized with SGLang's own
``MultiprocessingSerializer`` (CUDA IPC handles inside), one payload per engine TP rank. Only SGLang's own
classes and torch's rebuild functions are pickled, which both unpickler generations accept (≤0.5.20: module
prefixes; ≥0.5.21: an exact allow-list).

SGLang replies before its copies out of the IPC buffer have finished (no device sync before the reply), so a
buffer handed to SGLang is never reused: ``sglang_buckets`` packs every bucket into a fresh allocation, and
PyTorch's IPC refcount (consumer-side stream sync before release, then ``ipc_collect``) decides when the
caching allocator may hand that memory out again (sync.md §2.1, slime's comment).

Disaggregated (``update_weights_from_distributed``): the request names the bucket's tensors; the bytes arrive
by broadcast (``redline.sync.broadcast``).

Sessions: from 0.5.21 every update must sit between ``/begin_weight_update`` and ``/end_weight_update``; before
that those routes do not exist (404). ``update_session`` returns the calls for a given server version.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from packaging.version import InvalidVersion, Version

from redline.extras import require
from redline.rollout.engine import SerializedBucket
from redline.sync.plan import BucketLayout, WeightPlan, bucketize

SESSION_VERSION = (0, 5, 21)  # first SGLang release that requires begin/end_weight_update


def parse_version(version: str) -> tuple[int, ...]:
    """``"0.5.21.post1"`` -> ``(0, 5, 21)``; ValueError naming the string when it is not a version."""
    try:
        return Version(version).release[:3]
    except InvalidVersion as exc:
        raise ValueError(f"cannot read an SGLang version from {version!r} (expected like '0.5.21')") from exc


def needs_update_session(version: str) -> bool:
    """True when the server version requires ``begin_weight_update`` / ``end_weight_update``."""
    return parse_version(version) >= SESSION_VERSION


def update_session(version: str, updates: Iterable[tuple[str, dict]]) -> Iterator[tuple[str, dict]]:
    """The ``(endpoint, json body)`` calls of one weight update for SGLang ``version``: the updates, wrapped in
    a begin/end session when the version needs one."""
    session = needs_update_session(version)
    if session:
        yield "/begin_weight_update", {"selector": "all"}
    yield from updates
    if session:
        yield "/end_weight_update", {}


def update_from_tensor_body(bucket: SerializedBucket, *, flush_cache: bool = False,
                            weight_version: str | None = None) -> dict:
    """Body of ``POST /update_weights_from_tensor`` for one serialized bucket (all SGLang versions: the fields
    that differ between versions are left at their defaults). Flush once after the last bucket, not per bucket.
    """
    body = {"serialized_named_tensors": list(bucket.per_rank), "load_format": bucket.load_format,
            "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def update_from_distributed_body(layout: BucketLayout, *, group_name: str, flush_cache: bool = False,
                                 weight_version: str | None = None) -> dict:
    """Body of ``POST /update_weights_from_distributed`` announcing one flattened bucket broadcast; SGLang
    rebuilds the receive buffer with ``FlattenedTensorBucket`` from these names/dtypes/shapes, which gives the
    plan's byte layout (no padding, same order)."""
    body = {"names": layout.names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in layout.tensors],
            "shapes": [list(t.shape) for t in layout.tensors], "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def serialize_bucket(layout: BucketLayout, bucket: torch.Tensor, *, patch_device_uuid: bool = True) -> str:
    """One rank's payload for a packed bucket: SGLang's ``MultiprocessingSerializer`` (base64) of
    ``{"flattened_tensor", "metadata"}``. ``patch_device_uuid`` applies SGLang's reduction patch so the
    engine finds the GPU by UUID when its ``CUDA_VISIBLE_DEVICES`` differs from the trainer's."""
    require("sglang", "the SGLang weight-sync payload")
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    if patch_device_uuid and bucket.is_cuda:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    metadata = [FlattenedTensorMetadata(name=t.name, shape=torch.Size(t.shape), dtype=t.dtype,
                                        start_idx=t.start_idx, end_idx=t.end_idx, numel=t.numel)
                for t in layout.tensors]
    payload = {"flattened_tensor": bucket[:layout.nbytes], "metadata": metadata}
    return MultiprocessingSerializer.serialize(payload, output_str=True)


def sglang_buckets(plan: WeightPlan, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                   *, tp_size: int = 1) -> Iterator[SerializedBucket]:
    """Pack the export into one fresh buffer per bucket and yield it as a ``SerializedBucket`` for an SGLang
    engine with ``tp_size`` ranks on this GPU's engine (colocated, engine TP 1 per trainer rank: every rank gets
    the same payload; with engine TP > 1 each trainer rank serializes its own buffer and the payloads are
    gathered to the engine's first rank, see ``gather_rank_payloads``)."""
    for layout, tensors in bucketize(plan, named_tensors):
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)  # never reused: see module doc
        torch._foreach_copy_([m.view(buffer) for m in layout.tensors], list(tensors))
        payload = serialize_bucket(layout, buffer)
        yield SerializedBucket(per_rank=(payload,) * tp_size)
        del buffer
        if device.type == "cuda":
            torch.cuda.ipc_collect()  # release producer blocks SGLang has closed (sync.md §4: IPC cache leak)


def gather_rank_payloads(payload: str, group, engine_ranks: list[int]) -> SerializedBucket | None:
    """Colocated engine with TP > 1: every trainer rank on the engine's GPUs contributes its own payload
    (the bucket packed on its GPU); the engine's first rank gets them in engine-rank order, others get None.
    ``group`` is a gloo group over ``engine_ranks`` (global ranks, in engine TP order)."""
    import torch.distributed as dist

    dst = engine_ranks[0]
    gathered = [None] * len(engine_ranks) if dist.get_rank() == dst else None
    dist.gather_object(payload, gathered, dst=dst, group=group)
    return SerializedBucket(per_rank=tuple(gathered)) if gathered is not None else None
