"""Serializing a bucket of named tensors for ``/update_weights_from_tensor`` with ``load_format =
"flattened_bucket"`` (CUDA IPC: the server must run on the same host and see the tensors' GPU).

Uses SGLang's own ``FlattenedTensorBucket`` and ``MultiprocessingSerializer``, so the pickle names only classes
on the >= 0.5.21 allow-list, and SGLang's reduction patch, which names the GPU by UUID so the server maps the
handle to the right device whatever its ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import torch
from redline.extras import require
from redline.rollout.engine import SerializedBucket


def serialize_bucket(named_tensors: list[tuple[str, torch.Tensor]], tp_size: int = 1) -> SerializedBucket:
    """One flattened CUDA bucket, serialized once per engine TP rank. Keep the tensors alive (and unmodified)
    until the update call returns: the server reads them through IPC.

    Every rank gets the same handle, i.e. reads this GPU (peer access for ``tp_size > 1``); the colocated path
    with a copy on each engine GPU (``--rollout-num-gpus-per-engine``) serializes with ``tp_size=1`` on each
    trainer rank and gathers the payloads instead (``redline.sync.sglang.gathered_buckets``).
    """
    require("sglang", "SGLang weight updates")
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if not named_tensors or not all(t.is_cuda for _, t in named_tensors):
        raise ValueError("serialize_bucket needs a non-empty list of CUDA tensors (CUDA IPC payload)")
    monkey_patch_torch_reductions()
    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    payload = MultiprocessingSerializer.serialize(data, output_str=True)
    return SerializedBucket(per_rank=(payload,) * tp_size)
