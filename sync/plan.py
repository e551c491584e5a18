"""Bucket planning: which HF-named tensors travel together, and where each sits in its flat bucket.

A bucket is one flat ``uint8`` buffer holding whole tensors back to back, laid out exactly as SGLang's
``FlattenedTensorBucket`` lays them out: no padding, tensor ``i`` occupies bytes ``[start_idx, end_idx)``,
``start_idx`` of the first tensor is 0 and each tensor starts where the previous one ended. Because a bucket
holds one dtype only, every tensor starts at a multiple of its item size, which SGLang's receive-side
``FlattenedTensorBucket.empty`` requires.

Grouping rules (each group is atomic: all of it lands in one bucket):

* a group is "one transformer layer's tensors of one dtype" (``layer_group``); the sets SGLang fuses on load
  (q/k/v into qkv_proj, gate/up into gate_up_proj, an expert's w1/w3, DeepSeek's q_a/kv_a pair) are all
  inside one layer and share one dtype, so they can never straddle a bucket boundary (sync.md §4: a split
  pair silently keeps stale weights);
* tensors outside any layer (embeddings, final norm, lm_head) are groups of one;
* a group larger than the bucket size gets a bucket of its own, sized to it (never split).

Tied embeddings: with ``tie_word_embeddings`` the engine derives ``lm_head.weight`` from
``model.embed_tokens.weight`` (SGLang's Qwen2 copies it, Llama skips an incoming lm_head), so the plan drops
``lm_head.weight`` and records it as an alias of the embedding; receivers whose targets keep the two apart
copy the embedding into both.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

MiB = 1 << 20
DEFAULT_BUCKET_BYTES = 512 * MiB  # slime's --update-weight-buffer-size default

EMBEDDING_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"

_LAYER_PREFIX = re.compile(r"^(.*?\.(?:layers|blocks|h)\.\d+)\.")


def layer_group(name: str) -> str:
    """Group key of an HF tensor name: its layer prefix (``model.layers.3``), or the name itself."""
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else name


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs to know of one exported tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class TensorMeta:
    """One tensor's place in a bucket; the fields of SGLang's ``FlattenedTensorMetadata``.

    ``start_idx``/``end_idx`` are byte offsets into the bucket; ``numel`` is the byte count (SGLang counts
    elements of the uint8 view).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int

    @property
    def numel(self) -> int:
        return self.end_idx - self.start_idx

    def view(self, bucket: torch.Tensor) -> torch.Tensor:
        """This tensor as a view into ``bucket`` (flat uint8); no copy."""
        return bucket[self.start_idx:self.end_idx].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its position in the sync order, its dtype and its tensors in byte order."""

    index: int
    dtype: torch.dtype
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return self.tensors[-1].end_idx

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def views(self, bucket: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` for every tensor of this bucket inside the flat ``bucket``."""
        if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() < self.nbytes:
            raise ValueError(f"bucket {self.index}: expected a flat uint8 tensor of at least {self.nbytes} "
                             f"bytes, got {bucket.dtype} of shape {tuple(bucket.shape)}")
        return [(t.name, t.view(bucket)) for t in self.tensors]


@dataclass(frozen=True)
class WeightPlan:
    """The buckets of one model export, in sync order, plus the names the plan dropped as aliases."""

    buckets: tuple[BucketLayout, ...]
    aliases: dict[str, str] = field(default_factory=dict)  # dropped name -> name whose bytes it shares

    @property
    def capacity(self) -> int:
        """Bytes a staging buffer needs to hold any bucket of this plan."""
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def names(self) -> list[str]:
        return [name for bucket in self.buckets for name in bucket.names]


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 tie_word_embeddings: bool = False,
                 group_of: Callable[[str], str] = layer_group) -> WeightPlan:
    """Pack ``specs`` (in export order) into dtype-homogeneous buckets of at most ``bucket_bytes``.

    Groups (``group_of(name)`` per dtype) are kept whole and in export order; one bucket per dtype is open at
    a time, so the buckets of the dominant dtype come out in layer order and the few tensors of other dtypes
    (fp32 norms, fp8 scales) fill their own buckets alongside. A bucket is closed when the next group of its
    dtype does not fit. Raises ValueError on a repeated name, a non-positive bucket size or an empty tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    specs = list(specs)
    names = Counter(s.name for s in specs)
    duplicates = sorted(n for n, count in names.items() if count > 1)
    if duplicates:
        raise ValueError(f"the export names these tensors more than once: {duplicates}")
    aliases = {}
    if tie_word_embeddings and LM_HEAD_NAME in names and EMBEDDING_NAME in names:
        aliases[LM_HEAD_NAME] = EMBEDDING_NAME
        specs = [s for s in specs if s.name != LM_HEAD_NAME]
    for spec in specs:
        if spec.nbytes == 0:
            raise ValueError(f"tensor {spec.name!r} has no elements (shape {spec.shape}); nothing to sync")

    groups: dict[tuple[str, torch.dtype], list[TensorSpec]] = {}
    for spec in specs:  # dicts keep insertion order: groups stay in export order
        groups.setdefault((group_of(spec.name), spec.dtype), []).append(spec)

    closed: list[tuple[torch.dtype, list[TensorSpec]]] = []
    open_buckets: dict[torch.dtype, list[TensorSpec]] = {}
    for (_, dtype), members in groups.items():
        group_bytes = sum(s.nbytes for s in members)
        current = open_buckets.get(dtype)
        if current and sum(s.nbytes for s in current) + group_bytes > bucket_bytes:
            closed.append((dtype, open_buckets.pop(dtype)))
        open_buckets.setdefault(dtype, []).extend(members)
    closed.extend(open_buckets.items())
    return WeightPlan(tuple(_layout(i, dtype, members) for i, (dtype, members) in enumerate(closed)), aliases)


def _layout(index: int, dtype: torch.dtype, members: Sequence[TensorSpec]) -> BucketLayout:
    metas, offset = [], 0
    for spec in members:
        metas.append(TensorMeta(spec.name, spec.shape, dtype, offset, offset + spec.nbytes))
        offset += spec.nbytes
    return BucketLayout(index, dtype, tuple(metas))


def plan_for(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
             **kwargs) -> WeightPlan:
    """``plan_buckets`` over tensors (only their names, shapes and dtypes are read)."""
    return plan_buckets((TensorSpec.of(n, t) for n, t in named_tensors), bucket_bytes, **kwargs)


def bucketize(plan: WeightPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]
              ) -> Iterator[tuple[BucketLayout, list[torch.Tensor]]]:
    """Group a stream of ``(name, tensor)`` (the model's export, in export order) by ``plan``.

    Yields ``(layout, tensors)`` in plan order as soon as a bucket's last tensor has arrived; tensors of
    buckets still open (other dtypes) are held until then. Aliased names are consumed and dropped. Raises
    ValueError naming the tensor when the stream does not match the plan (unknown name, wrong shape or
    dtype, a tensor missing at the end).
    """
    where = {}
    for bucket in plan.buckets:
        for slot, meta in enumerate(bucket.tensors):
            where[meta.name] = (bucket.index, slot, meta)
    pending: dict[int, list[torch.Tensor | None]] = {}
    missing = {b.index: len(b.tensors) for b in plan.buckets}
    ready: dict[int, list[torch.Tensor]] = {}
    next_index = 0
    for name, tensor in named_tensors:
        if name in plan.aliases:
            continue
        if name not in where:
            raise ValueError(f"export produced {name!r}, which the weight plan does not contain; re-plan after "
                             "changing the model")
        index, slot, meta = where[name]
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(f"export produced {name!r} as {tensor.dtype}{list(tensor.shape)}, the plan expects "
                             f"{meta.dtype}{list(meta.shape)}")
        slots = pending.setdefault(index, [None] * len(plan.buckets[index].tensors))
        if slots[slot] is not None:
            raise ValueError(f"export produced {name!r} twice")
        slots[slot] = tensor
        missing[index] -= 1
        if missing[index] == 0:
            ready[index] = pending.pop(index)
        while next_index in ready:
            yield plan.buckets[next_index], ready.pop(next_index)
            next_index += 1
    if next_index != len(plan.buckets):
        absent = [m.name for i in sorted(pending) for m, t in zip(plan.buckets[i].tensors, pending[i]) if t is None]
        raise ValueError(f"export ended without the tensors {absent[:8]}{' ...' if len(absent) > 8 else ''}")


def named_buckets(plan: WeightPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The export grouped by ``plan`` as ``[(name, tensor)]`` per bucket, in layout order: the bucket form
    ``Engine.update_weights`` takes (an engine that flattens it gets exactly the plan's byte layout)."""
    for layout, tensors in bucketize(plan, named_tensors):
        yield list(zip(layout.names, tensors))
