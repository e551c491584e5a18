"""In-process colocated sync (``redline.sync.local``): staged pack + load with checksums, and the comparison
after direct copies; both name the buckets that differ."""

import pytest
import torch
from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import ROW_BYTES
from redline.sync.local import LocalSender, sampled_rows
from redline.sync.plan import plan_for
from redline.sync.protocol import ChecksumMismatch
from redline.sync.receiver import TargetLoader
from sync_export import layer_bytes, qwen3_export

BUCKET_BYTES = layer_bytes()  # a layer per bucket


def export():
    return qwen3_export(num_layers=4)


def targets_for(named):
    return {name: torch.zeros_like(t) for name, t in named}


@pytest.mark.parametrize("row_stride", [1, 16])
def test_staged_sync_writes_every_tensor_bit_exact(row_stride):
    named = export()
    plan = plan_for(named, BUCKET_BYTES)
    assert len(plan.buckets) > 2
    targets = targets_for(named)
    sender = LocalSender(plan, TargetLoader(targets), torch.device("cpu"), checksum_row_stride=row_stride)
    for _ in range(2):  # the slot is kept and reused
        report = sender.sync(named)
    assert report.mode == "staged" and report.buckets == len(plan.buckets)
    assert all(torch.equal(targets[name], t) for name, t in named)


def test_staged_sync_names_a_bucket_corrupted_between_pack_and_load(monkeypatch):
    named = export()
    plan = plan_for(named, BUCKET_BYTES)
    sender = LocalSender(plan, TargetLoader(targets_for(named)), torch.device("cpu"))
    pack, packed = BucketCopier.pack, []

    def corrupted(self, flat, nbytes, *args):
        pack(self, flat, nbytes, *args)
        packed.append(nbytes)
        if len(packed) == 2:
            flat[nbytes - 1] ^= 1  # the last byte of bucket 1

    monkeypatch.setattr(BucketCopier, "pack", corrupted)
    with pytest.raises(ChecksumMismatch, match=r"bucket\(s\) \[1\]"):
        sender.sync(named)


def test_check_copies_passes_equal_copies_and_names_the_bucket_that_differs():
    named = export()
    plan = plan_for(named, BUCKET_BYTES)
    targets = {name: t.clone() for name, t in named}
    sender = LocalSender(plan, TargetLoader(targets), torch.device("cpu"))
    sender.check_copies(named)
    victim = plan.buckets[2].names[-1]
    targets[victim].view(-1)[-1] += 1  # the last row of a tensor is always compared
    with pytest.raises(ChecksumMismatch, match=r"bucket\(s\) \[2\]"):
        sender.check_copies(named)


def test_sampled_rows_are_every_nth_row_and_the_last():
    data = torch.arange(5 * ROW_BYTES + 10, dtype=torch.int64) % 251
    tensor = data.to(torch.uint8)
    rows = sampled_rows(tensor, 2)
    expected = torch.cat([tensor[0:ROW_BYTES], tensor[2 * ROW_BYTES:3 * ROW_BYTES],
                          tensor[4 * ROW_BYTES:5 * ROW_BYTES], tensor[5 * ROW_BYTES:]])
    assert torch.equal(rows, expected)
    full = tensor[:4 * ROW_BYTES]  # a full last row (3) the stride skips is added
    assert torch.equal(sampled_rows(full, 2), torch.cat([full[:ROW_BYTES], full[2 * ROW_BYTES:]]))
    assert torch.equal(sampled_rows(tensor, 1), tensor)
