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
