"""SGLang as a receiver: what redline.sync adds to the SGLang engine of ``redline.rollout.sglang``.

Colocated (``/update_weights_from_tensor``, ``load_format="flattened_bucket"``): feed the engine the plan's
buckets, ``engine.update_weights(named_buckets(plan, model.export_hf()), version)``; the engine serializes each
bucket with SGLang's own ``FlattenedTensorBucket`` + ``MultiprocessingSerializer`` into a fresh buffer
(``redline.rollout.sglang.payload``), bucket k+1 while the server still loads bucket k (one request in flight),
and handles the ≥0.5.21 begin/end session; the loop then compares the server's ``/weights_checker`` hashes with
the sent tensors (``redline.rollout.sglang.weight_check``). A fresh buffer per bucket is
required there: SGLang replies before its copies out of the IPC buffer have finished, so only PyTorch's IPC
refcount (consumer stream sync before release, then ``ipc_collect``) may decide when that memory is reused
(sync.md §2.1). With engine TP > 1 (``--rollout-num-gpus-per-engine``), each trainer rank on the engine's GPUs
packs the bucket on its own GPU and the payloads are gathered to the engine's first rank, which sends one request
with the list (``gathered_buckets``; ``redline.loop.weight_sync.WeightSync`` with an engine seat).

Disaggregated (``/update_weights_from_distributed``): the request announces one flattened bucket, whose bytes
then arrive by broadcast from ``redline.sync.broadcast.BroadcastSender`` (``update_from_distributed_body``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import torch.distributed as dist

from redline.rollout.engine import NamedTensors, SerializedBucket
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
    None). ``group`` is a gloo group whose members are ``engine_ranks`` (global ranks, in engine TP order: the
    payload of ``engine_ranks[i]`` goes to engine TP rank ``i``, the one on its GPU)."""
    if sorted(engine_ranks) != list(engine_ranks):
        raise ValueError(f"engine_ranks {engine_ranks} must be in engine TP order, which is ascending rank order "
                         "(engine TP rank i sits on the GPU of the i-th rank)")
    dst = engine_ranks[0]
    gathered = [None] * len(engine_ranks) if dist.get_rank() == dst else None
    # gather_object orders the list by group rank, and a group's ranks follow its global ranks' order
    dist.gather_object(payload, gathered, dst=dst, group=group)
    return SerializedBucket(per_rank=tuple(gathered)) if gathered is not None else None


async def gathered_buckets(buckets: Iterable[NamedTensors], serialize_own: Callable[[NamedTensors], str],
                           group: dist.ProcessGroup, engine_ranks: list[int]) -> AsyncIterator[SerializedBucket]:
    """slime's per-rank ``update_weights_from_tensor`` lists, one bucket at a time: every rank of the engine
    serializes its own GPU's copy of the bucket (``serialize_own``: one payload string, CUDA-IPC handles into a
    fresh buffer on this rank's GPU) and the payloads are gathered to the engine's first rank, which yields one
    ``SerializedBucket`` (``per_rank[i]`` for engine TP rank ``i``) per bucket; the other ranks yield nothing
    and must still iterate to the end. Every rank iterates ``buckets`` in the same order (under TP/PP the
    stream's gathers and broadcasts are collectives too: ``redline.loop.parallel_sync.seat_parts``, whose
    (bucket, stage) parts each become one request); a bucket is let go once serialized. The blocking serialize and
    gather run on a worker thread, so the first rank's
    event loop keeps the previous bucket's update request moving meanwhile."""
    first = dist.get_rank() == engine_ranks[0]
    for bucket in buckets:
        payload = await asyncio.to_thread(serialize_own, list(bucket))
        del bucket  # the payload is a copy: the source may go before the next bucket is gathered (or received)
        gathered = await asyncio.to_thread(gather_rank_payloads, payload, group, engine_ranks)
        if first:
            yield gathered
