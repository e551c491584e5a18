"""Bucket checksums against a plain-Python definition (mod 2**64 sums of rows of int64 words)."""

import pytest
import torch

from redline.sync.checksum import ROW_BYTES, bucket_checksum

MASK = (1 << 64) - 1


def reference(data: bytes) -> list[int]:
    body = len(data) - len(data) % ROW_BYTES
    plain = weighted = 0
    for r in range(body // ROW_BYTES):
        row = data[r * ROW_BYTES:(r + 1) * ROW_BYTES]
        total = sum(int.from_bytes(row[i:i + 8], "little", signed=True) for i in range(0, ROW_BYTES, 8))
        plain += total
        weighted += (r + 1) * total
    for i, byte in enumerate(data[body:]):
        plain += byte
        weighted += (i + 1) * byte

    def signed(x):
        x &= MASK
        return x - (1 << 64) if x >> 63 else x

    return [signed(plain), signed(weighted)]


def random_bytes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", [0, 5, ROW_BYTES, 3 * ROW_BYTES + 123])
def test_checksum_matches_the_definition(nbytes):
    buf = random_bytes(nbytes + 64)
    assert bucket_checksum(buf, nbytes).tolist() == reference(bytes(buf[:nbytes].tolist()))


def test_swapping_two_rows_changes_the_checksum():
    buf = random_bytes(4 * ROW_BYTES)
    swapped = torch.cat([buf[ROW_BYTES:2 * ROW_BYTES], buf[:ROW_BYTES], buf[2 * ROW_BYTES:]])
    assert not torch.equal(bucket_checksum(buf, buf.numel()), bucket_checksum(swapped, swapped.numel()))


def test_one_changed_byte_changes_the_checksum():
    buf = random_bytes(2 * ROW_BYTES + 7)
    before = bucket_checksum(buf, buf.numel())
    buf[ROW_BYTES + 3] ^= 1
    assert not torch.equal(before, bucket_checksum(buf, buf.numel()))


def test_checksum_rejects_a_non_uint8_bucket():
    with pytest.raises(ValueError, match="uint8"):
        bucket_checksum(torch.zeros(8, dtype=torch.float32), 8)


def test_strided_checksum_reads_every_nth_row_with_its_true_position():
    buf = random_bytes(5 * ROW_BYTES + 11)
    data = bytes(buf.tolist())
    rows = [data[r * ROW_BYTES:(r + 1) * ROW_BYTES] for r in (0, 2, 4)]
    # rows 1 and 3 are skipped: zeroing them leaves the strided checksum unchanged ...
    skipped = bytearray(data)
    for r in (1, 3):
        skipped[r * ROW_BYTES:(r + 1) * ROW_BYTES] = bytes(ROW_BYTES)
    assert torch.equal(bucket_checksum(buf, buf.numel(), row_stride=2),
                       bucket_checksum(torch.tensor(list(skipped), dtype=torch.uint8), buf.numel(), row_stride=2))
    # ... and the value is the definition's over rows 0, 2, 4 at positions 1, 3, 5 plus the tail
    plain, weighted = reference(data[5 * ROW_BYTES:])
    for position, row in zip((1, 3, 5), rows):
        total = sum(int.from_bytes(row[i:i + 8], "little", signed=True) for i in range(0, ROW_BYTES, 8))
        plain, weighted = plain + total, weighted + position * total
    expected = [((v + (1 << 63)) % (1 << 64)) - (1 << 63) for v in (plain, weighted)]
    assert bucket_checksum(buf, buf.numel(), row_stride=2).tolist() == expected
