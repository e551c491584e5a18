"""Bucket checksums: two int64 numbers per bucket, computed on the bucket's device, no host synchronisation.

Definition, for the first ``nbytes`` bytes of a flat bucket:

* the bytes, zero-padded to a multiple of 8, are little-endian int64 words ``w_i``; word ``i`` lies in row
  ``r(i) = i // ROW_WORDS`` (rows of ``ROW_BYTES``; the last row may be partial);
* ``plain = sum_i w_i`` and ``weighted = sum_i (r(i) + 1) * w_i``, with wrap-around (mod 2**64) arithmetic.

Sums mod 2**64 do not depend on the reduction order, so the sender and the receiver agree bit for bit on any
device and any split of the work. ``weighted`` makes the value depend on where bytes sit at row granularity (a
stale or swapped row is caught, not only changed bytes). Because each word's contribution depends only on its
value and its position, the sums can be accumulated piecewise, tensor by tensor, in the same pass that copies
the bytes (``redline.sync.bucket_copy``): the pipelined sync pays no extra read for its checks.

``row_stride = s > 1`` counts only rows ``0, s, 2s, ...`` and the last row: 1/s of the bytes. It still catches a
stale, swapped or overwritten bucket (those change nearly every row) but not a change confined to skipped rows;
it exists for the zero-copy sync, whose sender reads its bytes for no other reason than the checksum.

``bucket_checksum`` is the plain-PyTorch definition (and the CPU path); checksums accumulated by the fused copy
kernel are spread over ``LANES`` partial pairs (fewer atomics on one address) that ``fold`` adds up.
"""

import torch

ROW_WORDS = 1024
ROW_BYTES = ROW_WORDS * 8
LANES = 64  # partial [plain, weighted] pairs per bucket in an accumulator (see fold)


def bucket_checksum(bucket: torch.Tensor, nbytes: int, row_stride: int = 1) -> torch.Tensor:
    """``[plain, weighted]`` int64 on ``bucket.device`` for the first ``nbytes`` of the flat uint8 ``bucket``.

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
    full_rows = nbytes // ROW_BYTES
    last_row = -(-nbytes // ROW_BYTES) - 1
    words = bucket[:full_rows * ROW_BYTES].view(torch.int64).view(full_rows, ROW_WORDS)
    rows = words[::row_stride].sum(dim=1)
    positions = torch.arange(1, full_rows + 1, row_stride, dtype=torch.int64, device=bucket.device)
    plain, weighted = rows.sum(), (rows * positions).sum()
    if last_row == full_rows - 1 and last_row >= 0 and last_row % row_stride:  # a full last row, not sampled
        last = words[last_row].sum()
        plain, weighted = plain + last, weighted + last * (last_row + 1)
    tail = nbytes - full_rows * ROW_BYTES
    if tail:  # the partial last row, zero-padded to whole words
        padded = torch.zeros(-(-tail // 8) * 8, dtype=torch.uint8, device=bucket.device)
        padded[:tail] = bucket[full_rows * ROW_BYTES:nbytes]
        last = padded.view(torch.int64).sum()
        plain, weighted = plain + last, weighted + last * (last_row + 1)
    return torch.stack([plain, weighted])


def new_accumulator(buckets: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed ``[buckets, LANES, 2]`` int64: where the fused copy kernel accumulates each bucket's checksum."""
    return torch.zeros(buckets, LANES, 2, dtype=torch.int64, device=device)


def fold(accumulator: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` checksums from ``[..., LANES, 2]`` partial sums (wrap-around int64 addition)."""
    return accumulator.sum(dim=-2)
