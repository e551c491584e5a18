"""Bucket checksums: one read of the bucket's bytes, on the bucket's device, no host synchronisation.

The checksum of ``nbytes`` bytes is two int64 numbers computed with wrap-around (mod 2**64) arithmetic:

* the body (the largest multiple of ``ROW_BYTES``) is read as int64 words in rows of ``ROW_BYTES``;
  ``row_r`` is the wrapped sum of row ``r``'s words;
* ``plain = sum_r row_r`` and ``weighted = sum_r (r + 1) * row_r``; the trailing bytes (fewer than
  ``ROW_BYTES``) add ``byte_i`` and ``(i + 1) * byte_i`` respectively.

Sums mod 2**64 do not depend on the reduction order, so the sender and the receiver agree bit for bit on any
device. ``weighted`` makes the value depend on where bytes sit at row granularity (a stale or swapped row is
caught, not only changed bytes). The only temporaries are one int64 per row (1/1024 of the bucket).

``row_stride = s > 1`` reads only rows ``0, s, 2s, ...`` (and the tail): 1/s of the bytes. It still catches a
stale, swapped or overwritten bucket (those change nearly every row) but not a change confined to skipped rows;
it exists because a full read on each side costs about one HBM copy of the model per sync (see
benchmarks/bench_sync.py, "stage: checksum only").
"""

import torch

ROW_WORDS = 1024
ROW_BYTES = ROW_WORDS * 8


def bucket_checksum(bucket: torch.Tensor, nbytes: int, row_stride: int = 1) -> torch.Tensor:
    """``[plain, weighted]`` int64 on ``bucket.device`` for the first ``nbytes`` of the flat uint8 ``bucket``
    (rows ``0, row_stride, 2 * row_stride, ...`` of the body, and the tail).

    The bucket must start at an 8-byte aligned address (staging buffers and parameter storages do).
    """
    if bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise ValueError(f"bucket_checksum needs a flat uint8 tensor, got {bucket.dtype} {tuple(bucket.shape)}")
    if not 0 <= nbytes <= bucket.numel():
        raise ValueError(f"bucket_checksum: nbytes={nbytes} outside the bucket's {bucket.numel()} bytes")
    if row_stride < 1:
        raise ValueError(f"bucket_checksum: row_stride must be >= 1, got {row_stride}")
    if bucket.data_ptr() % 8:
        raise ValueError("bucket_checksum needs an 8-byte aligned bucket (its first byte is not)")
    body = nbytes - nbytes % ROW_BYTES
    rows = bucket[:body].view(torch.int64).view(-1, ROW_WORDS)[::row_stride].sum(dim=1)
    positions = torch.arange(1, body // ROW_BYTES + 1, row_stride, dtype=torch.int64, device=bucket.device)
    tail = bucket[body:nbytes].to(torch.int64)
    tail_positions = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=bucket.device)
    plain = rows.sum() + tail.sum()
    weighted = (rows * positions).sum() + (tail * tail_positions).sum()
    return torch.stack([plain, weighted])
