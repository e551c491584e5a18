"""The one async interface every rollout engine implements (embedded, SGLang, a router over several).

The RL loop and the weight-sync path talk only to this protocol. Call order in a colocated step::

    results = await engine.generate(requests)      # rollout
    await engine.release_memory({"weights", "kv_cache"})   # trainer takes the GPU
    ...train...
    await engine.resume_memory({"weights"})        # stage 1: room for the new weights only
    await engine.update_weights(buckets, version)  # sync
    await engine.resume_memory({"kv_cache"})       # stage 2: KV cache (and CUDA graphs) back
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from redline.rollout.types import GenerateRequest, GenerateResult

MEMORY_TAGS = frozenset({"weights", "kv_cache"})

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SerializedBucket:
    """A weight bucket already serialized for a server engine: one payload per engine TP rank.

    Each payload is what SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` makes of
    ``{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]}`` (CUDA IPC handles inside).
    """

    per_rank: tuple[str, ...]
    load_format: str = "flattened_bucket"


WeightBucket = NamedTensors | SerializedBucket
WeightBuckets = Iterable[WeightBucket] | AsyncIterable[WeightBucket]


def check_tags(tags: Iterable[str]) -> frozenset[str]:
    """The tags as a set, or ValueError naming the unknown ones."""
    tags = frozenset(tags)
    unknown = tags - MEMORY_TAGS
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; valid tags are {sorted(MEMORY_TAGS)}")
    return tags


async def iterate_buckets(buckets: WeightBuckets):
    """Yield the buckets of a plain or async iterable, so engines accept both (async lets sync pipeline)."""
    if isinstance(buckets, AsyncIterable):
        async for bucket in buckets:
            yield bucket
    else:
        for bucket in buckets:
            yield bucket


@runtime_checkable
class Engine(Protocol):
    """An inference engine. All methods are coroutines; an engine serves one event loop."""

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Complete every request; results come back in request order. Requests cut short by ``pause``
        finish with ``FinishReason.ABORT`` and carry the tokens produced so far."""

    async def update_weights(self, buckets: WeightBuckets, version: str) -> None:
        """Load new weights bucket by bucket (HF parameter names), then report ``version`` on later results.

        A bucket is a sequence of ``(name, tensor)`` or, for server engines, a ``SerializedBucket``. Buckets
        may be partial: names not sent keep their old values. The prefix cache is flushed afterwards."""

    async def release_memory(self, tags: Iterable[str]) -> None:
        """Free GPU memory held for ``tags`` (subset of MEMORY_TAGS). Only legal while no request runs.
        Releasing "weights" loses their values: resume, then ``update_weights`` before generating."""

    async def resume_memory(self, tags: Iterable[str]) -> None:
        """Re-allocate what ``release_memory`` freed for ``tags``."""

    async def flush_cache(self) -> None:
        """Drop cached prefixes (stale after a weight update)."""

    async def pause(self) -> None:
        """Abort running and queued requests; until ``resume``, new requests return at once. All of them
        finish with FinishReason.ABORT, carrying whatever tokens they had produced."""

    async def resume(self) -> None:
        """Serve requests again after ``pause``."""

    async def health(self) -> bool:
        """True when the engine answers and can generate."""

    async def shutdown(self) -> None:
        """Release every resource (processes, servers, GPU memory). Idempotent."""
