"""SGLang as a receiver: what redline.sync adds to the SGLang engine of ``redline.rollout.sglang``.

Colocated (``/update_weights_from_tensor``, ``load_format="flattened_bucket"``): feed the engine the plan's
buckets, ``engine.update_weights(named_buckets(plan, model.export_hf()), version)``; the engine serializes each
bucket with SGLang's own ``FlattenedTensorBucket`` + ``MultiprocessingSerializer`` into a fresh buffer
(``redline.rollout.sglang.payload``), bucket k+1 while the server still loads bucket k (one request in flight),
and handles the ≥0.5.21 begin/end session; the loop then compares the server's ``/weights_checker`` hashes with
the sent tensors (``redline.rollout.sglang.weight_check``). A fresh buffer per bucket is
required there: SGLang replies before its copies out of the IPC buffer have finished, so only PyTorch's IPC
refcount (consumer stream sync before release, then ``ipc_collect``) may decide when that memory is reused
(sync.md §2.1). With engine TP > 1, each trainer rank packs the bucket on its own GPU and the payloads are
gathered to the engine's first rank (``gather_rank_payloads``).

Disaggregated (``/update_weights_from_distributed``): the request announces one flattened bucket, whose bytes
then arrive by broadcast from ``redline.sync.broadcast.BroadcastSender`` (``update_from_distributed_body``).
"""

from __future__ import annotations

import torch.distributed as dist

from redline.rollout.engine import SerializedBucket
from redline.sync.plan import BucketLayout


def update_from_distributed_body(layout: BucketLayout, *, group_name: str, flush_cache: bool = False,
                                 weight_version: str | None = None) -> dict:
    """Body of ``POST /update_weights_from_distributed`` announcing one flattened bucket broadcast. SGLang builds
    its receive buffer with ``FlattenedTensorBucket`` from these names/dtypes/shapes, which reproduces the plan's
    byte layout (same order, no padding). Flush once after the last bucket, not per bucket."""
    body = {"names": layout.names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in layout.tensors],
            "shapes": [list(t.shape) for t in layout.tensors], "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def gather_rank_payloads(payload: str, group: dist.ProcessGroup, engine_ranks: list[int]) -> SerializedBucket | None:
    """Colocated engine with TP > 1: every trainer rank on the engine's GPUs contributes the payload of the
    bucket it packed on its own GPU; the engine's first rank receives them in engine-rank order (the others get
    None). ``group`` is a gloo group; ``engine_ranks`` are its global ranks in engine TP order."""
    dst = engine_ranks[0]
    gathered = [None] * len(engine_ranks) if dist.get_rank() == dst else None
    dist.gather_object(payload, gathered, dst=dst, group=group)
    return SerializedBucket(per_rank=tuple(gathered)) if gathered is not None else None
