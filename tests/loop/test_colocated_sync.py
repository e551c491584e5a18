"""Every colocated push of the loop goes through ``redline.sync`` and is checked: the embedded engine process
over the pipelined protocol (shared memory on the CPU) or zero-copy, the in-process engine by direct copies or
staged pack + load; a bucket corrupted on its way fails the push with an error naming it. The transition's
phases are timed as ``perf/*`` metrics."""

import pytest
import torch
from redline.configfile import ConfigError, apply_overrides
from redline.loop.builtin import materialize
from redline.loop.step import rl_step
from redline.loop.train import build, shutdown
from redline.loop.weight_sync import IN_PROCESS_ENV, SAMPLED_ROW_STRIDE, SHARE_ENV, ZERO_COPY_ENV
from redline.rollout.embedded.weights import WeightLoader
from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import ROW_BYTES
from redline.sync.protocol import ChecksumMismatch, SyncError
from rich.console import Console

from .test_train import small_config

BUCKET_BYTES = 128 * 1024  # ~16 checksum rows per bucket of the tiny fp32 model
TRANSITION = ("perf/release_time", "perf/resume_weights_time", "perf/sync_time", "perf/resume_kv_time")


def built(tmp_path, **overrides):
    config = small_config(tmp_path, sft_steps="0", update_weight_buffer_size=str(BUCKET_BYTES), **overrides)
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    state, _ = build(config, Console(quiet=True))
    return state


def held_by_engine(state) -> dict[str, torch.Tensor]:
    engine = state.engine
    if hasattr(engine, "export_weights"):
        return dict(state.loop.run_until_complete(engine.export_weights()))
    return {name: t.detach().cpu() for name, t in engine.model.export_hf()}


def assert_engine_holds_the_trainers_weights(state):
    held = held_by_engine(state)
    for name, tensor in state.worker.model.export_hf():
        if name not in state.weight_sync.plan.aliases:
            assert torch.equal(held[name], tensor.detach().cpu()), name


def corrupt_pack(monkeypatch, bucket: int, offset: int):
    """The sender's copier flips byte ``offset`` of bucket ``bucket`` after packing it (and checksumming what
    it packed): corruption on the way to the engine."""
    pack, calls = BucketCopier.pack, []

    def corrupted(self, flat, nbytes, spans, tensors, acc, row_stride=1):
        pack(self, flat, nbytes, spans, tensors, acc, row_stride)
        calls.append(nbytes)
        if len(calls) == bucket + 1:
            flat[offset] ^= 0xFF

    monkeypatch.setattr(BucketCopier, "pack", corrupted)


@pytest.mark.slow  # spawns the engine process (a few seconds)
def test_engine_process_receives_every_push_over_the_protocol(tmp_path):
    state = built(tmp_path, embedded_engine_process="true", offload_rollout="true")
    try:
        sync = state.weight_sync
        assert sync.mode == "pipelined" and sync.sender.row_stride == SAMPLED_ROW_STRIDE
        metrics = [rl_step(state, i) for i in range(2)]
        assert_engine_holds_the_trainers_weights(state)
        slots = list(sync.sender._slots)
        rl_step(state, 2)
        assert [s.data_ptr() for s in sync.sender._slots] == [s.data_ptr() for s in slots]  # persistent slots
    finally:
        shutdown(state)
    for m in metrics:
        assert all(m[k] > 0 for k in TRANSITION)
        parts = m["perf/resume_weights_time"] + m["perf/sync_time"] + m["perf/resume_kv_time"]
        assert parts <= m["perf/update_weights_time"]
        assert m["perf/release_time"] <= m["perf/offload_rollout_time"]
    # the second rollout sampled with the weights the first step trained
    assert metrics[1]["train/rollout_logprob_abs_diff"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("check_weights,offset", [("false", 0), ("true", ROW_BYTES + 3)])
def test_a_corrupted_bucket_fails_the_push_naming_it(tmp_path, monkeypatch, check_weights, offset):
    """Row 0 is in every sample; row 1 only when --check-weights checks every row."""
    state = built(tmp_path, embedded_engine_process="true", check_weights=check_weights)
    try:
        assert state.weight_sync.sender.row_stride == (1 if check_weights == "true" else SAMPLED_ROW_STRIDE)
        assert state.weight_sync.plan.buckets[2].nbytes > 2 * ROW_BYTES
        corrupt_pack(monkeypatch, bucket=2, offset=offset)
        with pytest.raises(ChecksumMismatch, match=r"buckets \[2\]"):
            rl_step(state, 0)
    finally:
        shutdown(state)


def write_trainer_weights_in_place(state) -> None:
    """Flip the trainer's embedding rows in place, with no push."""
    with torch.no_grad():
        weight = state.worker.model.embed_tokens.weight
        weight.copy_(torch.flip(weight, dims=[0]))


@pytest.mark.slow
@pytest.mark.parametrize("share", ["1", "0"])
def test_zero_copy_out_of_the_mixed_precision_trainers_flat_compute_buffer(tmp_path, monkeypatch, share):
    """bf16 training keeps the compute weights in one flat buffer per dtype (fp32 master weights beside it): the
    plan is ranges of that buffer. By default the engine process takes it as its weights (shared: each push only
    checksums it in place); with REDLINE_SYNC_SHARE=0 it copies straight out of it. A checksum that differs names
    the bucket."""
    check_flat_buffer_sync(tmp_path, monkeypatch, share)


@pytest.mark.gpu
def test_on_a_gpu_the_engine_process_reads_the_trainers_weights_over_cuda_ipc(tmp_path, monkeypatch):
    check_flat_buffer_sync(tmp_path, monkeypatch, "1")


def check_flat_buffer_sync(tmp_path, monkeypatch, share: str) -> None:
    monkeypatch.setenv(SHARE_ENV, share)
    state = built(tmp_path, embedded_engine_process="true", dtype="bfloat16", offload_rollout="true")
    try:
        sync = state.weight_sync
        assert sync.mode == ("shared" if share == "1" else "zero-copy") and len(sync.plan.buckets) > 2
        buffer = state.worker.model.embed_tokens.weight.untyped_storage().data_ptr()
        assert all(f.untyped_storage().data_ptr() == buffer for f in sync.flat)  # the trainer's own storage
        metrics = [rl_step(state, i) for i in range(2)]
        assert_engine_holds_the_trainers_weights(state)
        assert all(m[k] > 0 for m in metrics for k in TRANSITION)
        assert metrics[1]["train/rollout_logprob_abs_diff"] < 1e-2  # sampled with the trained (bf16) weights
        write_trainer_weights_in_place(state)
        held = held_by_engine(state)["model.embed_tokens.weight"]
        assert torch.equal(held, state.worker.model.embed_tokens.weight.detach().cpu()) == (share == "1")
        unpack, calls = BucketCopier.unpack, []

        def wrong_sum(self, flat, nbytes, spans, tensors, acc, row_stride=1):  # the sender's checksum pass
            unpack(self, flat, nbytes, spans, tensors, acc, row_stride)
            calls.append(nbytes)
            if len(calls) == 2:
                acc[0, 0] += 1

        monkeypatch.setattr(BucketCopier, "unpack", wrong_sum)
        monkeypatch.setattr(BucketCopier, "checksum", lambda self, flat, nbytes, acc, row_stride=1: wrong_sum(
            self, flat, nbytes, [(0, nbytes)], [None], acc, row_stride))
        with pytest.raises(ChecksumMismatch, match=r"buckets \[1\]"):
            rl_step(state, 2)
        monkeypatch.undo()
        param = next(state.worker.model.parameters())
        param.data = param.data.clone()  # out of the planned storage: zero-copy would read stale bytes
        with pytest.raises(SyncError, match="no longer live in the storage"):
            state.loop.run_until_complete(sync.push("9"))
    finally:
        shutdown(state)


@pytest.mark.slow
def test_a_closed_shared_sync_leaves_the_engine_its_own_copy(tmp_path):
    """Closing the sync (the trainer no longer promises to leave its buffers alone) makes the engine process copy
    what it shared: later writes of the trainer's weights do not reach it."""
    state = built(tmp_path, embedded_engine_process="true", dtype="bfloat16")
    try:
        rl_step(state, 0)
        assert state.weight_sync.mode == "shared"
        state.loop.run_until_complete(state.weight_sync.close())
        before = held_by_engine(state)["model.embed_tokens.weight"]
        write_trainer_weights_in_place(state)
        assert torch.equal(held_by_engine(state)["model.embed_tokens.weight"], before)
    finally:
        shutdown(state)


def test_in_process_engine_uses_the_trainers_tensors(tmp_path):
    """bf16 training, in-process engine: its parameters are the trainer's compute tensors (same addresses), each
    push checks that and publishes the version; an engine parameter moved away is put back by the next push."""
    check_in_process_sharing(tmp_path)


@pytest.mark.gpu
def test_on_a_gpu_the_in_process_engine_uses_the_trainers_tensors(tmp_path):
    check_in_process_sharing(tmp_path)


def check_in_process_sharing(tmp_path) -> None:
    state = built(tmp_path, dtype="bfloat16", offload_rollout="true")
    try:
        sync, engine = state.weight_sync, state.engine
        assert sync.mode == "shared" and "in place" in sync.describe()
        metrics = [rl_step(state, i) for i in range(2)]
        assert all(m[k] > 0 for m in metrics for k in TRANSITION)
        trained = dict(state.worker.model.named_parameters())
        assert all(p.data_ptr() == trained[n].data_ptr() for n, p in engine.model.named_parameters())
        assert engine.weight_version == "2"
        engine.weights.unshare()  # e.g. a load of other weights
        assert engine.model.embed_tokens.weight.data_ptr() != trained["embed_tokens.weight"].data_ptr()
        rl_step(state, 2)
        assert engine.model.embed_tokens.weight.data_ptr() == trained["embed_tokens.weight"].data_ptr()
    finally:
        shutdown(state)


def test_in_process_staged_push_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(IN_PROCESS_ENV, "staged")
    state = built(tmp_path, offload_rollout="true")
    try:
        assert state.weight_sync.mode == "staged"
        metrics = rl_step(state, 0)
        assert_engine_holds_the_trainers_weights(state)
        assert all(metrics[k] > 0 for k in TRANSITION)
        corrupt_pack(monkeypatch, bucket=1, offset=5)
        with pytest.raises(ChecksumMismatch, match=r"bucket\(s\) \[1\]"):
            rl_step(state, 1)
    finally:
        shutdown(state)


def test_in_process_direct_copies_are_compared(tmp_path, monkeypatch):
    monkeypatch.setenv(IN_PROCESS_ENV, "direct")  # the CPU's default; a GPU's is staged
    state = built(tmp_path)
    try:
        assert state.weight_sync.mode == "direct"
        rl_step(state, 0)
        assert_engine_holds_the_trainers_weights(state)
        victim = state.weight_sync.plan.buckets[3].names[0]
        load = WeightLoader.load

        def corrupted(self, named_tensors, wait=True):
            load(self, named_tensors, wait)
            tensor, offset, size = self.slices[victim]
            with torch.no_grad():
                tensor.narrow(0, offset, size).view(-1)[0] += 1.0  # row 0: in every sample

        monkeypatch.setattr(WeightLoader, "load", corrupted)
        with pytest.raises(ChecksumMismatch, match=r"bucket\(s\) \[3\]"):
            rl_step(state, 1)
    finally:
        shutdown(state)


def test_an_unknown_in_process_mode_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(IN_PROCESS_ENV, "fast")
    with pytest.raises(ValueError, match=IN_PROCESS_ENV):
        built(tmp_path)


@pytest.mark.parametrize("variable", [SHARE_ENV, ZERO_COPY_ENV])
def test_a_sync_switch_other_than_0_or_1_is_refused_at_start_up_naming_it(tmp_path, monkeypatch, variable):
    from redline.loop.validate import validate

    monkeypatch.setenv(variable, "off")
    config = small_config(tmp_path, embedded_engine_process="true")
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    with pytest.raises(ConfigError, match=f"{variable} must be 0 or 1, got 'off'"):
        validate(config)


@pytest.mark.parametrize("free,emptied", [(10 * 2**30, False), (9 * 2**29, True)])
def test_the_trainers_cache_is_emptied_only_when_the_engine_would_not_fit(monkeypatch, free, emptied):
    """The engine gave 4 GiB back at its release; with 10 GiB free it resumes beside the trainer's cached blocks,
    with 4.5 GiB (less than 4 GiB + the 1 GiB headroom) they go back to the driver first."""
    import asyncio

    from redline.loop import train_offload, weight_sync

    calls = []
    monkeypatch.setattr(train_offload, "device_memory", lambda device: (free, 80 * 2**30))
    monkeypatch.setattr(weight_sync.torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    sync = object.__new__(weight_sync.WeightSync)
    sync.device, sync.engine_bytes = torch.device("cuda"), 4 * 2**30
    asyncio.run(sync._make_room())
    assert calls == (["empty_cache"] if emptied else [])
