"""The pipelined protocol over CPU shared memory between processes: ordering, slot reuse, checksums,
failures, and bit-exact weights over repeated syncs."""

import contextlib
import multiprocessing as mp

import pytest
import torch
import sync_procs
from sync_export import layer_bytes, qwen3_export

from redline.sync.plan import plan_for
from redline.sync.protocol import ChecksumMismatch, ReceiverFailed, SyncError, WeightSender
from redline.sync.receiver import TargetLoader
from redline.sync.transport import SharedMemoryTransport

# fork: the CPU-only receiver inherits torch already imported, which keeps these tests fast; CUDA tests spawn.
CTX = mp.get_context("fork")
TIMEOUT_S = 60.0


def start(target, *args, ctx=CTX):
    """A receiver process and a sender connected to it."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()  # the child's end lives in the child only: its exit closes the channel
    return proc, parent


def sender_for(conn, proc, plan, **kwargs):
    return WeightSender(conn, SharedMemoryTransport(), plan, timeout=TIMEOUT_S, alive=proc.is_alive, **kwargs)


def stop(sender, proc):
    sender.close()
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 0


@contextlib.contextmanager
def connected(target, *args, plan, ctx=CTX, **sender_kwargs):
    """A receiver process running ``target(conn, *args)`` and a sender to it; when the block ends the sender
    closes the channel and the receiver must have exited cleanly (exit code 0)."""
    proc, conn = start(target, *args, ctx=ctx)
    sender = sender_for(conn, proc, plan, **sender_kwargs)
    try:
        yield sender
    except BaseException:
        proc.kill()  # the block failed: do not leave the receiver behind
        raise
    stop(sender, proc)


def flat_buckets(plan, export):
    """The export laid out in one shared flat uint8 buffer per bucket (parameters living in flat storage)."""
    flats = [torch.empty(b.nbytes, dtype=torch.uint8).share_memory_() for b in plan.buckets]
    for bucket, flat in zip(plan.buckets, flats):
        for name, view in bucket.views(flat):
            view.copy_(dict(export)[name])
    return flats


def counting_setup(export):
    """A plan of one layer per bucket, the shared ``counts`` of ``counting_receiver`` (buffers opened, still mapped)
    and shared zeroed targets."""
    plan = plan_for(export, bucket_bytes=layer_bytes())
    return plan, torch.zeros(2, dtype=torch.int64).share_memory_(), sync_procs.shared_zeros_like(export)


def assert_targets_equal(targets, export, plan=None):
    for name, tensor in export:
        source = (plan.aliases.get(name, name) if plan else name)
        assert torch.equal(targets[name], dict(export)[source]), name


def test_twenty_syncs_leave_bit_exact_weights():
    export = qwen3_export(num_layers=4)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with connected(sync_procs.copy_receiver, targets, plan=plan) as sender:
        for step in range(20):
            export = qwen3_export(num_layers=4, seed=step)
            report = sender.sync(export)
            assert report.buckets == len(plan.buckets) and report.nbytes == plan.nbytes
            assert_targets_equal(targets, export)


def test_tied_lm_head_is_filled_from_the_embedding():
    export = qwen3_export(num_layers=1)
    plan = plan_for(export, tie_word_embeddings=True)
    targets = sync_procs.shared_zeros_like(export)  # the engine keeps lm_head as a separate tensor
    with connected(sync_procs.copy_receiver, targets, plan.aliases, plan=plan) as sender:
        sender.sync(export)
        assert torch.equal(targets["lm_head.weight"], dict(export)["model.embed_tokens.weight"])


def test_sender_runs_ahead_by_one_bucket_and_never_by_more_than_the_slots():
    export = qwen3_export(num_layers=6)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    produced = torch.zeros(1, dtype=torch.int64).share_memory_()
    seen = torch.full((len(plan.buckets),), -1, dtype=torch.int64).share_memory_()
    with connected(sync_procs.watching_receiver, targets, produced, seen, 0.05, plan=plan, num_slots=2) as sender:
        def counted():
            for item in export:
                yield item
                produced[0] += 1

        sender.sync(counted())
        # tensors of buckets 0..k, i.e. what the sender must have produced to pack bucket k
        through = torch.tensor([len(b.tensors) for b in plan.buckets]).cumsum(0)
        assert_targets_equal(targets, export)
        for k in range(1, len(plan.buckets)):
            # bucket k's load starts only after its tensors were packed ...
            assert seen[k] >= through[k] - 1
            # ... and bucket k+2 cannot have been packed yet (its slot is the one bucket k is read from), so no
            # tensor of bucket k+3 can have been pulled from the export
            if k + 2 < len(plan.buckets):
                assert seen[k] <= through[k + 2]


def test_one_slot_is_correct_too():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with connected(sync_procs.copy_receiver, targets, plan=plan, num_slots=1) as sender:
        sender.sync(export)
        assert_targets_equal(targets, export)


def test_bytes_changed_on_the_receiver_side_raise_checksum_mismatch():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with (connected(sync_procs.corrupting_receiver, targets, 2, plan=plan) as sender,
          pytest.raises(ChecksumMismatch, match=r"buckets \[2\]")):
        sender.sync(export)


def test_receiver_crash_is_reported_not_waited_for():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    proc, conn = start(sync_procs.crashing_receiver, sync_procs.shared_zeros_like(export), 1)
    sender = sender_for(conn, proc, plan)
    with pytest.raises(ReceiverFailed, match="exited|closed the channel"):
        sender.sync(export)
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 3


def test_receiver_error_carries_its_traceback_and_the_next_sync_succeeds():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with connected(sync_procs.failing_once_receiver, targets, plan=plan) as sender:
        with pytest.raises(ReceiverFailed, match="simulated load failure"):
            sender.sync(export)
        sender.sync(export)
        assert_targets_equal(targets, export)


def test_zero_copy_sync_exports_flat_storage_without_packing():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    flats = flat_buckets(plan, export)
    targets = sync_procs.shared_zeros_like(export)
    with connected(sync_procs.copy_receiver, targets, plan=plan) as sender:
        report = sender.sync_flat(flats)
        assert report.mode == "zero-copy"
        assert_targets_equal(targets, export)


@pytest.mark.parametrize("receiver,error", [(sync_procs.failing_open_receiver, "simulated mapping failure"),
                                            (sync_procs.failing_once_receiver, "simulated load failure")])
def test_a_zero_copy_sync_that_fails_in_the_receiver_is_reported_and_the_next_one_works(receiver, error):
    """A failure to map or to load in a zero-copy session raises with the receiver's traceback, and both sides
    start the next session clean."""
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    flats = flat_buckets(plan, export)
    targets = sync_procs.shared_zeros_like(export)
    with connected(receiver, targets, plan=plan) as sender:
        with pytest.raises(ReceiverFailed, match=error):
            sender.sync_flat(flats)
        assert sender.sync_flat(flats).mode == "zero-copy"
        assert_targets_equal(targets, export)


def test_a_shared_sync_into_a_loader_that_cannot_share_fails_naming_why():
    """share=True asks the receiver to take the buffers as its weights; a loader without ``share`` copies them
    (checked as usual) and the sender raises with the receiver's reason instead of carrying on unshared."""
    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with connected(sync_procs.copy_receiver, targets, plan=plan) as sender:
        with pytest.raises(SyncError, match="did not take the buffers as its weights.*TargetLoader"):
            sender.sync_flat(flat_buckets(plan, export), share=True)
        assert_targets_equal(targets, export)
        with pytest.raises(ValueError, match="must stay mapped"):
            sender.sync_flat(flat_buckets(plan, export), share=True, keep_mapped=False)


def test_target_loader_names_a_tensor_the_receiver_lacks():
    loader = TargetLoader({"a": torch.zeros(2)})
    with pytest.raises(KeyError, match="'b'"):
        loader([("b", torch.ones(2))])


def test_target_loader_names_a_tensor_whose_shape_differs():
    loader = TargetLoader({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="'a'"):
        loader([("a", torch.ones(3))])


def test_non_strict_target_loader_skips_and_counts_unknown_names():
    targets = {"a": torch.zeros(2)}
    loader = TargetLoader(targets, strict=False)
    loader([("a", torch.ones(2)), ("b", torch.ones(2))])
    assert torch.equal(targets["a"], torch.ones(2)) and loader.skipped == {"b"} and loader.loaded == {"a"}


def test_target_loader_prepares_each_bucket_before_writing_it():
    """An engine whose weights were released allocates each bucket's tensors in ``prepare``, just before the
    bucket is written: the loads land in the new memory."""
    from redline.sync.checksum import new_accumulator

    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = {name: torch.zeros_like(t) for name, t in export}
    storages = {name: t.untyped_storage() for name, t in targets.items()}
    for storage in storages.values():
        storage.resize_(0)
    prepared = []

    def prepare(names):
        prepared.append(list(names))
        for name in names:
            storages[name].resize_(targets[name].numel() * targets[name].element_size())

    loader = TargetLoader(targets, prepare=prepare)
    acc = new_accumulator(len(plan.buckets), "cpu")
    for bucket, flat in zip(plan.buckets[1:], flat_buckets(plan, export)[1:]):
        loader.load_bucket(flat, bucket, acc[bucket.index])
    loader(plan.buckets[0].views(flat_buckets(plan, export)[0]))
    assert prepared == [b.names for b in plan.buckets[1:]] + [plan.buckets[0].names]
    assert_targets_equal(targets, export)


def test_target_process_owns_its_weights_and_shares_them_with_the_trainer():
    from redline.sync.receiver import target_process

    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    specs = [(n, tuple(t.shape), t.dtype) for n, t in export]
    proc, conn = start(target_process, specs, "shm", True)
    weights = conn.recv()
    sender_for(conn, proc, plan).sync(export)
    assert_targets_equal(weights, export)
    stop(WeightSender(conn, SharedMemoryTransport(), plan), proc)


def test_target_loader_leaves_a_shared_tied_tensor_alone():
    embedding = torch.zeros(4, 2)
    targets = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding}
    loader = TargetLoader(targets, aliases={"lm_head.weight": "model.embed_tokens.weight"})
    loader([("model.embed_tokens.weight", torch.ones(4, 2))])
    assert loader.mirrors == {} and torch.equal(embedding, torch.ones(4, 2))


def test_sampled_checksums_still_catch_a_scribbled_bucket():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with (connected(sync_procs.corrupting_receiver, targets, 1, plan=plan, checksum_row_stride=4) as sender,
          pytest.raises(ChecksumMismatch, match=r"buckets \[1\]")):  # the scribble hits row 0 of the bucket
        sender.sync(export)


def test_staging_slots_are_mapped_once_for_all_syncs():
    export = qwen3_export(num_layers=4)
    plan, counts, targets = counting_setup(export)
    with connected(sync_procs.counting_receiver, targets, counts, plan=plan, num_slots=2) as sender:
        slots = None
        for step in range(5):
            export = qwen3_export(num_layers=4, seed=step)
            sender.sync(export)
            assert_targets_equal(targets, export)
            slots = slots or [s.data_ptr() for s in sender._slots]
            assert [s.data_ptr() for s in sender._slots] == slots  # the same staging buffers every sync
        assert counts.tolist() == [2, 2]


def test_release_unmaps_the_slots_and_the_next_sync_maps_new_ones():
    export = qwen3_export(num_layers=3)
    plan, counts, targets = counting_setup(export)
    with connected(sync_procs.counting_receiver, targets, counts, plan=plan, num_slots=2) as sender:
        sender.sync(export)
        sender.release()
        assert counts[1] == 0 and sender._slots == []
        export = qwen3_export(num_layers=3, seed=1)
        sender.sync(export)
        assert_targets_equal(targets, export)
        assert counts.tolist() == [4, 2]


def test_zero_copy_maps_each_flat_bucket_once_and_unmaps_buffers_no_longer_used():
    export = qwen3_export(num_layers=3)
    plan, counts, targets = counting_setup(export)
    with connected(sync_procs.counting_receiver, targets, counts, plan=plan) as sender:
        flats = flat_buckets(plan, export)
        for _ in range(3):
            sender.sync_flat(flats)
        assert counts.tolist() == [len(plan.buckets)] * 2
        export = qwen3_export(num_layers=3, seed=5)
        sender.sync_flat(flat_buckets(plan, export))  # the trainer moved its parameters: new buffers
        assert_targets_equal(targets, export)
        assert counts.tolist() == [2 * len(plan.buckets), len(plan.buckets)]


def test_pipelined_and_zero_copy_syncs_alternate_on_one_connection():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with connected(sync_procs.copy_receiver, targets, plan=plan) as sender:
        for step in range(4):
            export = qwen3_export(num_layers=3, seed=step)
            sender.sync(export) if step % 2 else sender.sync_flat(flat_buckets(plan, export))
            assert_targets_equal(targets, export)


def test_fused_triton_load_and_pack_agree_with_each_other():
    pytest.importorskip("triton")
    from redline.sync.bucket_copy import BucketCopier

    export = qwen3_export(num_layers=3, norm_dtype=torch.float32)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    # spawn: a process forked after this one ran Triton's interpreter can hang in it
    with connected(sync_procs.triton_receiver, targets, plan=plan, ctx=mp.get_context("spawn"),
                   copier=BucketCopier("triton")) as sender:
        for step in range(3):
            export = qwen3_export(num_layers=3, seed=step, norm_dtype=torch.float32)
            sender.sync(export)
            assert_targets_equal(targets, export)


def test_a_target_loader_skipping_names_still_checks_the_whole_bucket():
    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = {n: t for n, t in sync_procs.shared_zeros_like(export).items() if "q_norm" not in n}
    with connected(sync_procs.lenient_receiver, targets, plan=plan) as sender:
        sender.sync(export)
        assert all(torch.equal(targets[n], t) for n, t in export if n in targets)


def test_buffers_shared_for_one_sync_only_are_unmapped_when_it_ends():
    export = qwen3_export(num_layers=2)
    plan, counts, targets = counting_setup(export)
    with connected(sync_procs.counting_receiver, targets, counts, plan=plan) as sender:
        for step in range(2):
            export = qwen3_export(num_layers=2, seed=step)
            sender.sync_flat(flat_buckets(plan, export), keep_mapped=False)
            assert_targets_equal(targets, export)
            assert counts[1] == 0 and sender._mapped == {}


def test_senders_sharing_a_connection_keep_their_own_state():
    export = qwen3_export(num_layers=3)
    plan, counts, targets = counting_setup(export)
    proc, conn = start(sync_procs.counting_receiver, targets, counts)
    first, second = sender_for(conn, proc, plan), sender_for(conn, proc, plan, num_slots=1)
    for step in range(4):
        export = qwen3_export(num_layers=3, seed=step)
        (first if step % 2 else second).sync(export)
        assert_targets_equal(targets, export)
    assert counts.tolist() == [3, 3]  # 2 + 1 slots, each mapped once
    first.release()
    assert counts[1] == 1
    stop(second, proc)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["pipelined", "zero-copy"])
def test_a_sync_carries_its_weight_version_to_a_loader_that_publishes_it_once_every_bucket_is_in(zero_copy):
    export = qwen3_export(num_layers=2)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets, published = sync_procs.shared_zeros_like(export), torch.zeros(3, dtype=torch.int64).share_memory_()
    with connected(sync_procs.publishing_receiver, targets, published, plan=plan) as sender:
        for version in (7, 8):
            if zero_copy:
                sender.sync_flat(flat_buckets(plan, export), keep_mapped=False, version=str(version))
            else:
                sender.sync(export, version=str(version))
            assert published.tolist() == [version - 6, version, len(plan.buckets)]  # after every bucket
        sender.sync(export)  # no version: nothing published
        assert published[0] == 2
    assert_targets_equal(targets, export)


@pytest.mark.parametrize(("receiver", "error", "match"), [
    ("copy_receiver", SyncError, "no publish_version, so weight version '4' was not published"),
    ("refusing_receiver", ReceiverFailed, "version 4 refused"),  # the receiver's traceback
], ids=["no-publish_version", "publish_version-raises"])
def test_a_version_the_receiver_does_not_publish_fails_the_sync_saying_why_and_the_channel_still_serves(
        receiver, error, match):
    export = qwen3_export(num_layers=1)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    targets = sync_procs.shared_zeros_like(export)
    with connected(getattr(sync_procs, receiver), targets, plan=plan) as sender:
        with pytest.raises(error, match=match):
            sender.sync(export, version="4")
        sender.sync(export)
    assert_targets_equal(targets, export)
