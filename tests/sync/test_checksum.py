"""Bucket checksums against a plain-Python definition (mod 2**64 sums of zero-padded int64 words, weighted by
their row)."""

import pytest
import torch

from redline.sync.checksum import LANES, ROW_BYTES, bucket_checksum, fold, new_accumulator

MASK = (1 << 64) - 1


def signed(x):
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def reference(data: bytes, row_stride: int = 1) -> list[int]:
    """The definition, word by word: rows r % row_stride == 0 and the last row are counted."""
    padded = data + bytes(-len(data) % 8)
    words = [int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, len(padded), 8)]
    last_row = (len(words) - 1) // (ROW_BYTES // 8)
    plain = weighted = 0
    for i, word in enumerate(words):
        row = i // (ROW_BYTES // 8)
        if row % row_stride == 0 or row == last_row:
            plain += word
            weighted += (row + 1) * word
    return [signed(plain), signed(weighted)]


def random_bytes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", [0, 5, ROW_BYTES, 3 * ROW_BYTES + 123])
def test_checksum_matches_the_definition(nbytes):
    buf = random_bytes(nbytes + 64)
    assert bucket_checksum(buf, nbytes).tolist() == reference(bytes(buf[:nbytes].tolist()))


@pytest.mark.parametrize("nbytes", [5 * ROW_BYTES + 11, 4 * ROW_BYTES, 5 * ROW_BYTES])
def test_strided_checksum_counts_every_nth_row_and_the_last(nbytes):
    buf = random_bytes(nbytes)
    assert bucket_checksum(buf, nbytes, row_stride=2).tolist() == reference(bytes(buf.tolist()), row_stride=2)


def test_bytes_past_nbytes_do_not_count():
    buf = random_bytes(ROW_BYTES + 3)
    other = buf.clone()
    other[ROW_BYTES + 1:] ^= 0xFF
    assert torch.equal(bucket_checksum(buf, ROW_BYTES + 1), bucket_checksum(other, ROW_BYTES + 1))


def test_swapping_two_rows_changes_the_checksum():
    buf = random_bytes(4 * ROW_BYTES)
    swapped = torch.cat([buf[ROW_BYTES:2 * ROW_BYTES], buf[:ROW_BYTES], buf[2 * ROW_BYTES:]])
    assert not torch.equal(bucket_checksum(buf, buf.numel()), bucket_checksum(swapped, swapped.numel()))


def test_one_changed_byte_changes_the_checksum():
    buf = random_bytes(2 * ROW_BYTES + 7)
    before = bucket_checksum(buf, buf.numel())
    buf[ROW_BYTES + 3] ^= 1
    assert not torch.equal(before, bucket_checksum(buf, buf.numel()))


def test_a_change_in_a_skipped_row_is_invisible_to_the_strided_checksum():
    buf = random_bytes(5 * ROW_BYTES + 11)
    before = bucket_checksum(buf, buf.numel(), row_stride=2)
    buf[ROW_BYTES + 5] ^= 1  # row 1: skipped with stride 2
    assert torch.equal(before, bucket_checksum(buf, buf.numel(), row_stride=2))


def test_checksum_rejects_a_non_uint8_bucket():
    with pytest.raises(ValueError, match="uint8"):
        bucket_checksum(torch.zeros(8, dtype=torch.float32), 8)


def test_fold_adds_the_lanes_with_wrap_around():
    acc = new_accumulator(2, "cpu")
    acc[1, 0, 0] = (1 << 63) - 1
    acc[1, LANES - 1, 0] = 2
    acc[1, 3, 1] = 7
    assert fold(acc).tolist() == [[0, 0], [signed((1 << 63) + 1), 7]]
