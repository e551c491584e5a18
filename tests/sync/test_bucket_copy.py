"""The fused bucket copy + checksum: the Triton kernel (under TRITON_INTERPRET=1 here) against plain PyTorch
copies and ``bucket_checksum`` of the flat bucket, for every alignment path it takes."""

import pytest
import torch
from sync_export import layer_bytes, qwen3_export

from redline.sync.bucket_copy import BucketCopier, choose_backend
from redline.sync.checksum import ROW_BYTES, bucket_checksum, fold, new_accumulator
from redline.sync.plan import plan_for
from redline.sync.protocol import layout_spans

def triton_copier():
    pytest.importorskip("triton")
    return BucketCopier("triton")


def bucket_of(tensors):
    """Spans of ``tensors`` laid out back to back (the plan's layout) and the bucket's size."""
    spans, offset = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        spans.append((offset, offset + size))
        offset += size
    return spans, offset


def random_tensors(numels, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for n in numels]


def pack_and_check(copier, tensors, row_stride=1):
    spans, nbytes = bucket_of(tensors)
    flat = torch.full((nbytes + 32,), 7, dtype=torch.uint8)
    acc = new_accumulator(1, "cpu")
    copier.pack(flat, nbytes, spans, tensors, acc[0], row_stride)
    expected = torch.cat([t.view(-1).view(torch.uint8) for t in tensors])
    assert torch.equal(flat[:nbytes], expected)
    assert fold(acc)[0].tolist() == bucket_checksum(flat, nbytes, row_stride).tolist()
    return flat, spans, nbytes


@pytest.mark.parametrize("numels", [
    [8, 4096 * 3 + 8, 24],  # 16-byte aligned: int64 words with vector hints; a tensor spans three rows
    [4, 5000, 4],  # 8-byte aligned only
    [3, 5000, 7, 9000],  # odd sizes: 2-byte units, pieces start mid-row
], ids=["aligned16", "aligned8", "odd"])
def test_pack_writes_the_plan_layout_and_its_checksum(numels):
    pack_and_check(triton_copier(), random_tensors(numels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.float64])
def test_pack_handles_every_item_size(dtype):
    pack_and_check(triton_copier(), random_tensors([3, 2100, 5], dtype=dtype))


@pytest.mark.parametrize("row_stride", [2, 3])
def test_sampled_checksum_matches_the_definition(row_stride):
    pack_and_check(triton_copier(), random_tensors([9 * ROW_BYTES // 2 + 4]), row_stride)


def test_unpack_restores_the_tensors_and_checksums_what_it_read():
    copier = triton_copier()
    tensors = random_tensors([3, 5000, 7, 9000])
    flat, spans, nbytes = pack_and_check(BucketCopier("torch"), tensors)
    out = [torch.zeros_like(t) for t in tensors]
    acc = new_accumulator(1, "cpu")
    copier.unpack(flat, nbytes, spans, out, acc[0])
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))
    assert fold(acc)[0].tolist() == bucket_checksum(flat, nbytes).tolist()


def test_unpack_without_a_target_still_checksums_that_tensor():
    copier = triton_copier()
    tensors = random_tensors([16, 4096, 8])
    flat, spans, nbytes = pack_and_check(BucketCopier("torch"), tensors)
    out = [torch.zeros_like(tensors[0]), None, torch.zeros_like(tensors[2])]
    acc = new_accumulator(1, "cpu")
    copier.unpack(flat, nbytes, spans, out, acc[0])
    assert torch.equal(out[0], tensors[0]) and torch.equal(out[2], tensors[2])
    assert fold(acc)[0].tolist() == bucket_checksum(flat, nbytes).tolist()


def test_checksum_only_reads_without_writing():
    copier = triton_copier()
    flat = torch.randint(0, 256, (3 * ROW_BYTES + 13,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    before = flat.clone()
    acc = new_accumulator(1, "cpu")
    copier.checksum(flat, flat.numel(), acc[0], row_stride=2)
    assert torch.equal(flat, before)
    assert fold(acc)[0].tolist() == bucket_checksum(flat, flat.numel(), 2).tolist()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("row_stride", [1, 2])
def test_gather_checksum_equals_the_packed_buckets_without_writing(backend, row_stride):
    copier = triton_copier() if backend == "triton" else BucketCopier("torch")
    tensors = random_tensors([3, 5000, 7, 9000])
    flat, spans, nbytes = pack_and_check(BucketCopier("torch"), tensors, row_stride)
    # the tensors somewhere else (an engine's parameters), read in place against an unrelated origin
    elsewhere = [t.clone() for t in tensors]
    origin = torch.zeros(nbytes, dtype=torch.uint8)
    acc = new_accumulator(1, "cpu")
    copier.gather_checksum(origin, nbytes, spans, elsewhere, acc[0], row_stride)
    assert fold(acc)[0].tolist() == bucket_checksum(flat, nbytes, row_stride).tolist()
    assert not origin.any() and all(torch.equal(a, b) for a, b in zip(elsewhere, tensors))
    elsewhere[3][-1] += 1  # a changed element in a counted (the last) row is caught
    acc.zero_()
    copier.gather_checksum(origin, nbytes, spans, elsewhere, acc[0], row_stride)
    assert fold(acc)[0].tolist() != bucket_checksum(flat, nbytes, row_stride).tolist()


def test_a_source_at_an_odd_address_takes_the_narrow_path():
    storage = random_tensors([4097])[0]
    tensors = [storage[1:], random_tensors([8], seed=3)[0]]  # starts 2 bytes into its storage
    pack_and_check(triton_copier(), tensors)


def test_a_non_contiguous_target_falls_back_to_plain_copies():
    copier = triton_copier()
    tensors = random_tensors([64, 32])
    flat, spans, nbytes = pack_and_check(BucketCopier("torch"), tensors)
    target = torch.zeros(8, 8, dtype=torch.bfloat16).t()
    acc = new_accumulator(1, "cpu")
    copier.unpack(flat, nbytes, spans, [target, None], acc[0])
    assert torch.equal(target.reshape(-1), tensors[0])
    assert fold(acc)[0].tolist() == bucket_checksum(flat, nbytes).tolist()


def test_accumulators_add_up_across_calls():
    copier = triton_copier()
    tensors = random_tensors([4096])
    spans, nbytes = bucket_of(tensors)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    acc = new_accumulator(1, "cpu")
    copier.pack(flat, nbytes, spans, tensors, acc[0])
    copier.pack(flat, nbytes, spans, tensors, acc[0])
    once = bucket_checksum(flat, nbytes)
    assert fold(acc)[0].tolist() == (once * 2).tolist()


def test_a_real_plan_round_trips_through_a_slot():
    copier = triton_copier()
    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    slot = torch.empty(plan.capacity, dtype=torch.uint8)
    tensors = dict(export)
    for layout in plan.buckets:
        sent, got = new_accumulator(1, "cpu"), new_accumulator(1, "cpu")
        copier.pack(slot, layout.nbytes, layout_spans(layout), [tensors[n] for n in layout.names], sent[0])
        out = [torch.empty_like(tensors[n]) for n in layout.names]
        copier.unpack(slot, layout.nbytes, layout_spans(layout), out, got[0])
        assert all(torch.equal(o, tensors[n]) for o, n in zip(out, layout.names))
        assert torch.equal(fold(sent), fold(got))


def test_repeated_copies_of_the_same_tensors_reuse_their_table():
    copier = triton_copier()
    tensors = random_tensors([100, 200])
    spans, nbytes = bucket_of(tensors)
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(3):
        copier.pack(flat, nbytes, spans, tensors, new_accumulator(1, "cpu")[0])
    assert len(copier._tables) == 1 and len(copier._owners) == 1


def test_a_tensor_that_does_not_fill_its_span_is_rejected():
    with pytest.raises(ValueError, match="does not fill"):
        BucketCopier("torch").pack(torch.empty(64, dtype=torch.uint8), 64, [(0, 64)], [torch.zeros(4)],
                                   new_accumulator(1, "cpu")[0])


def test_an_unknown_backend_is_named():
    with pytest.raises(ValueError, match="REDLINE_SYNC_COPY"):
        choose_backend(torch.device("cpu"), "cuda-magic")
