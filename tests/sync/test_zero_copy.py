"""Zero-copy plans over weights that live in one flat storage per dtype (``redline.sync.zero_copy``): ranges of
the storage with the alignment gaps between tensors, aliases for repeated views, and None whenever the export is
not laid out that way."""

import pytest
import torch
from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import fold, new_accumulator
from redline.sync.protocol import layout_spans
from redline.sync.zero_copy import plan_in_place

SIZES = [("a", 100), ("b", 3), ("c", 250), ("d", 64), ("e", 1000)]  # elements; each view starts 64-aligned


def flat_export(dtype=torch.bfloat16, fill=0.0):
    """``[(name, view)]`` into one flat storage, every view at a 64-element aligned offset (gaps filled)."""
    offsets, total = [], 0
    for _, n in SIZES:
        offsets.append(total)
        total += -(-n // 64) * 64
    flat = torch.full((total,), fill, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    named = []
    for (name, n), offset in zip(SIZES, offsets):
        view = flat[offset:offset + n]
        view.copy_(torch.randn(n, generator=gen))
        named.append((name, view))
    return flat, named, offsets


def test_ranges_of_the_storage_hold_every_tensor_at_its_place():
    flat, named, _ = flat_export()
    plan, ranges = plan_in_place(named, bucket_bytes=800)
    # byte ranges a [0, 200) b [256, 262) | c [384, 884) d [896, 1024) | e [1024, 3024), larger than a bucket
    assert [b.names for b in plan.buckets] == [["a", "b"], ["c", "d"], ["e"]]
    for layout, flat_range in zip(plan.buckets, ranges):
        assert flat_range.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # no copy
        for (name, view), tensor in zip(layout.views(flat_range), [t for n, t in named if n in layout.names]):
            assert torch.equal(view, tensor) and view.data_ptr() == tensor.data_ptr()
    assert plan.buckets[0].tensors[1].start_idx == 128 * 2  # the gap after "a" is kept, not packed away


def test_a_repeated_view_is_an_alias():
    _, named, _ = flat_export()
    plan, _ = plan_in_place([*named, ("tied", named[0][1])], bucket_bytes=1 << 20)
    assert plan.aliases == {"tied": "a"} and "tied" not in plan.names()


@pytest.mark.parametrize("case", ["separate storages", "two storages of one dtype", "overlap", "non-contiguous"])
def test_exports_not_laid_out_in_one_storage_per_dtype_get_none(case):
    _, named, _ = flat_export()
    if case == "separate storages":
        named = [(n, t.clone()) for n, t in named]
    elif case == "two storages of one dtype":
        named = [*named, ("x", torch.zeros(4, dtype=torch.bfloat16))]
    elif case == "overlap":
        named = [*named, ("x", named[2][1][1:5])]
    else:
        named = [*named[:-1], ("e", named[-1][1].view(10, 100).t())]
    assert plan_in_place(named, bucket_bytes=1 << 20) is None


def test_the_checksum_of_a_range_ignores_its_gaps():
    """The zero-copy sender checksums the spans (``unpack`` without targets), as the receiver's load does: what
    the gaps hold never makes a mismatch (Triton kernel under the interpreter)."""
    pytest.importorskip("triton")
    copier = BucketCopier("triton")
    sums = []
    for fill in (0.0, 3.0):
        _, named, _ = flat_export(fill=fill)
        plan, ranges = plan_in_place(named, bucket_bytes=1 << 20)
        layout = plan.buckets[0]
        acc = new_accumulator(2, "cpu")
        copier.unpack(ranges[0], layout.nbytes, layout_spans(layout), [None] * len(layout.tensors), acc[0])
        targets = [torch.empty_like(t) for _, t in named]
        copier.unpack(ranges[0], layout.nbytes, layout_spans(layout), targets, acc[1])
        assert all(torch.equal(t, s) for t, (_, s) in zip(targets, named))
        sums.append(fold(acc).tolist())
    assert sums[0][0] == sums[0][1] == sums[1][0]
