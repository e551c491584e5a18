"""Serializing a bucket of named tensors for ``/update_weights_from_tensor`` (CUDA IPC: the server must run on
the same host and see the tensors' GPU): with ``load_format = "flattened_bucket"`` (``serialize_bucket``), or for
redline's checked loader (``CheckedPacker``, ``redline.rollout.sglang.checked_load``).

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
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if not named_tensors or not all(t.is_cuda for _, t in named_tensors):
        raise ValueError("serialize_bucket needs a non-empty list of CUDA tensors (CUDA IPC payload)")
    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    payload = serialize_payload({"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()})
    return SerializedBucket(per_rank=(payload,) * tp_size)


def serialize_payload(obj) -> str:
    """SGLang's ``MultiprocessingSerializer`` string of ``obj`` (CUDA tensors as IPC handles, GPUs named by UUID)."""
    require("sglang", "SGLang weight updates")
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return MultiprocessingSerializer.serialize(obj, output_str=True)


class CheckedPacker:
    """One push's buckets for servers that load with redline's checked loader (``checked_load.LOADER``).

    ``pack`` copies a bucket's tensors into a fresh flat buffer on ``device`` and takes its checksum in the same
    pass (``BucketCopier.pack``; every ``row_stride``-th row), then serializes one payload per server: the same
    buffer, whose tail holds each server's result slot, under a header naming that server's slot. ``verify`` —
    after every server has answered for every bucket — compares, in one host synchronisation, what each server
    read back out of its parameters with what was packed, and raises ``WeightsMismatch`` naming the server, the
    bucket and its tensors. ``collect`` after servers have answered copies their slots out and lets the buckets
    go (a push holds no more than the buckets in flight).
    """

    def __init__(self, device: torch.device, row_stride: int, urls: list[str]):
        from redline.sync.bucket_copy import BucketCopier

        self.device, self.row_stride, self.urls = torch.device(device), row_stride, list(urls)
        self.copier = BucketCopier()
        self.packed: list[torch.Tensor] = []  # per bucket: [LANES, 2] accumulator of the sent bytes
        self.results: list[torch.Tensor] = []  # per bucket: [servers, RESULT_WORDS] what each server found
        self.names: list[list[str]] = []
        self._answering: list[list[torch.Tensor]] = []  # result slots (views of their buckets) not collected yet

    def pack(self, named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
        """One payload string per server for this bucket (tensors back to back, the plan's layout)."""
        from redline.rollout.sglang.checked_load import RESULT_WORDS, UNWRITTEN, encode_header, result_slot
        from redline.rollout.sglang.weight_check import engine_regions
        from redline.sync.checksum import new_accumulator

        if not named_tensors or not all(t.device == self.device for _, t in named_tensors):
            raise ValueError(f"CheckedPacker.pack needs a non-empty list of tensors on {self.device}")
        spans, rows, nbytes = [], [], 0
        for (name, tensor), (engine_name, offset) in zip(named_tensors, engine_regions(named_tensors)):
            size = tensor.numel() * tensor.element_size()
            spans.append((nbytes, nbytes + size))
            rows.append((name, tensor.dtype, tuple(tensor.shape), nbytes, nbytes + size, engine_name, offset))
            nbytes += size
        slots = -(-nbytes // 8) * 8  # the result slots, 8-byte aligned after the bucket's bytes
        flat = torch.empty(slots + len(self.urls) * RESULT_WORDS * 8, dtype=torch.uint8, device=self.device)
        offsets = [slots + i * RESULT_WORDS * 8 for i in range(len(self.urls))]
        words = flat[slots:].view(torch.int64).view(len(self.urls), RESULT_WORDS)
        words.zero_()
        words[:, 2] = UNWRITTEN  # until a server writes its result there
        acc = new_accumulator(1, self.device)[0]
        self.copier.pack(flat, nbytes, spans, [t for _, t in named_tensors], acc, self.row_stride)
        payloads = tuple(serialize_payload([(encode_header(nbytes, self.row_stride, offset, rows), flat)])
                         for offset in offsets)
        self.packed.append(acc)
        self._answering.append([result_slot(flat, offset) for offset in offsets])
        self.names.append([name for name, _ in named_tensors])
        return payloads

    def collect(self, unanswered: int = 0) -> None:
        """Copy the result slots of the buckets packed so far, but the last ``unanswered``, out of their buckets
        (their requests must have been answered: a server writes its slot before it answers) and drop them."""
        answered = len(self._answering) - unanswered
        self.results += [torch.stack(slots) for slots in self._answering[:answered]]
        del self._answering[:answered]

    def verify(self) -> list[str]:
        """Raise ``WeightsMismatch`` unless every server that wrote its results read back every bucket as it was
        packed; returns the servers that wrote none (they loaded a copy of the payloads: a server on another GPU
        than the trainer's), whose load needs another check. A server that wrote some results but not all
        raises too."""
        from redline.rollout.sglang.checked_load import UNWRITTEN, describe
        from redline.rollout.sglang.weight_check import WeightsMismatch
        from redline.sync.checksum import fold

        self.collect()
        if not self.packed:
            return []
        sent = fold(torch.stack(self.packed)).tolist()  # [buckets, 2]
        found = torch.stack(self.results).tolist()  # [buckets, servers, RESULT_WORDS]
        silent = [url for i, url in enumerate(self.urls) if all(per_server[i][2] == UNWRITTEN for per_server in found)]
        for bucket, (expected, per_server) in enumerate(zip(sent, found)):
            for url, (plain, weighted, status, reason) in zip(self.urls, per_server):
                if url in silent:
                    continue
                names = self.names[bucket]
                where = f"{url}: bucket {bucket} ({len(names)} tensors, {names[0]} … {names[-1]})"
                if status == UNWRITTEN:
                    raise WeightsMismatch(f"{where} was not checked: the server wrote no result for it (its log "
                                          f"may say why)")
                if status or reason:
                    raise WeightsMismatch(f"{where} could not be checked: {describe(status, reason, names)}")
                if [plain, weighted] != expected:
                    raise WeightsMismatch(f"{where}: the server's parameters read back checksum {[plain, weighted]}"
                                          f", the bucket sent {expected}")
        return silent
