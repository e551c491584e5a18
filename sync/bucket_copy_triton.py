"""The Triton kernel of ``redline.sync.bucket_copy``: copy a bucket's tensors and accumulate its checksum.

Program ``p`` handles one piece of one tensor: tensor ``owner[p]``, restricted to one checksum row of the
bucket (rows are ``ROW_BYTES``; a piece is at most one row). Its table row holds, in units of ``UNIT`` bytes
from the base pointer (the flat bucket): the source and destination start, the tensor's position in the bucket,
its length, the first program of the tensor and whether to copy (0: checksum only). It loads the piece, stores
it, and when the row is counted (``row % row_stride == 0`` or the last row) adds ``sum(word contributions)`` and
``(row + 1) * sum(...)`` to lane ``p % LANES`` of the accumulator with two atomics (int64, wrap-around).

A word contribution is the unit's bits zero-extended and shifted to its byte place in its 8-byte word, so the
sum over a row equals the sum of the row's little-endian int64 words (``redline.sync.checksum``). With
``UNIT == 8`` that is the word itself. ``VEC == 2`` promises the compiler that starts and lengths are even
(16-byte aligned int64 pairs), which lets it move 16 bytes per access.
"""

import torch
import triton
import triton.language as tl

from redline.sync.checksum import LANES, ROW_BYTES

NUM_WARPS = 4


@triton.jit
def _copy_checksum_kernel(base_ptr, table_ptr, owner_ptr, acc_ptr, row_stride, last_row,
                          ROW_UNITS: tl.constexpr, UNIT: tl.constexpr, VEC: tl.constexpr, COPY: tl.constexpr,
                          LANES: tl.constexpr):
    pid = tl.program_id(0)
    row_ptr = table_ptr + tl.load(owner_ptr + pid).to(tl.int64) * 6
    src = tl.load(row_ptr)
    dst = tl.load(row_ptr + 1)
    pos = tl.load(row_ptr + 2)
    units = tl.load(row_ptr + 3)
    first = tl.load(row_ptr + 4)
    copy_flag = tl.load(row_ptr + 5)
    row = pos // ROW_UNITS + (pid - first)
    lo = tl.maximum(row * ROW_UNITS, pos) - pos  # the piece, in units from the tensor's start
    hi = tl.minimum(row * ROW_UNITS + ROW_UNITS, pos + units) - pos
    if VEC > 1:
        src = tl.multiple_of(src, VEC)
        dst = tl.multiple_of(dst, VEC)
        lo = tl.multiple_of(lo, VEC)
        hi = tl.multiple_of(hi, VEC)
    offs = lo + tl.arange(0, ROW_UNITS)
    mask = offs < hi
    counted = ((row % row_stride) == 0) | (row == last_row)
    if COPY:
        x = tl.load(base_ptr + src + offs, mask=mask, other=0)
        copy_hi = tl.where(copy_flag != 0, hi, lo)  # an empty store for checksum-only tensors
        tl.store(base_ptr + dst + offs, x, mask=offs < copy_hi)
    if counted:
        if not COPY:
            x = tl.load(base_ptr + src + offs, mask=mask, other=0)
        if UNIT == 8:
            words = x.to(tl.int64)
        else:
            bits = x.to(tl.int64) & ((1 << (8 * UNIT)) - 1)
            words = bits << (((pos + offs) * UNIT % 8) * 8)
        plain = tl.sum(words, axis=0)
        lane = acc_ptr + (pid % LANES) * 2
        tl.atomic_add(lane, plain)
        tl.atomic_add(lane + 1, plain * (row + 1))


def launch(base: torch.Tensor, table: torch.Tensor, owner: torch.Tensor, acc: torch.Tensor, programs: int,
           row_stride: int, last_row: int, *, unit: int, vec: int, copy: bool) -> None:
    """One launch over ``programs`` pieces; ``base`` is the flat bucket viewed as ``unit``-byte integers."""
    _copy_checksum_kernel[(programs,)](base, table, owner, acc, row_stride, last_row, ROW_UNITS=ROW_BYTES // unit,
                                       UNIT=unit, VEC=vec, COPY=copy, LANES=LANES, num_warps=NUM_WARPS)
