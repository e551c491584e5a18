"""Data parallelism under ``torchrun``: each rank trains on its shard of the rollouts with its own colocated
engine, and together they take the steps one process takes on the whole batch (gloo on the CPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from redline.configfile import ConfigError, apply_overrides
from redline.loop.validate import check_data_parallel, check_placement

from .test_train import small_config

QUICKSTART = ["examples/quickstart.toml", "--sft-steps", "3", "--eval-interval", "2", "--rollout-batch-size", "24",
              "--global-batch-size", "192"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(out, *args, ranks: int = 1):
    """``redline train`` on the quickstart, in one process or under ``torchrun`` with ``ranks`` processes."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    cmd = [*launcher, "-m", "redline.cli", "train", *QUICKSTART, "--output-dir", str(out), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (out / "console.log").write_text(done.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_records(expected, actual, *, rtol=1e-4, atol=1e-6):
    """Equal up to rounding: the ranks step fp32 master shards whose clip factor divides inside the fused update,
    where one fp32 process multiplies its gradients by the reciprocal; ulps that grow to ~1e-5 over a few steps."""
    assert [r["step"] for r in actual] == [r["step"] for r in expected]
    for want, got in zip(expected, actual):
        keys = [k for k in want if not k.startswith("perf/")]  # timings differ; everything else must not
        assert sorted(keys) == sorted(k for k in got if not k.startswith("perf/"))
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=rtol, abs=atol), (want["step"], key)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo); on GPUs see test_two_gpu_ranks_train_sync_and_resume")
    out = tmp_path_factory.mktemp("dp2")
    records = train(out, "--num-rollout", "3", "--save-interval", "2", "--save-hf", str(out / "hf"), ranks=2)
    return out, records


@pytest.mark.slow
def test_two_ranks_take_the_single_process_steps(two_ranks, tmp_path):
    out, records = two_ranks
    console = " ".join((out / "console.log").read_text().split())  # the console wraps long lines
    assert "data parallel: 2 ranks, fp32 master weights and AdamW moments sharded over them (ZeRO-1)" in console
    single = train(tmp_path, "--num-rollout", "3", "--save-hf", str(tmp_path / "hf"))
    assert len(records) == 4 and "eval/reward_mean" in records[0] and "eval/reward_mean" in records[2]
    assert_same_records(single, records)
    one, two = load_file(tmp_path / "hf" / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    assert sorted(one) == sorted(two)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
def test_two_ranks_resume_from_a_checkpoint_on_the_same_trajectory(two_ranks, tmp_path):
    out, records = two_ranks
    folder = out / "checkpoints" / "rollout_1"
    assert sorted(p.name for p in folder.iterdir()) == ["model", "rank0.json", "rank0.safetensors", "rank1.json",
                                                        "rank1.safetensors", "state.json", "state.safetensors"]
    resumed = train(tmp_path, "--num-rollout", "3", "--load", str(folder), ranks=2)
    assert_same_records(records[-1:], resumed)
    # found at start-up, before any model loads (the console may wrap the message)
    with pytest.raises(AssertionError, match=r"(?s)error:.*saved\s+at\s+layout\s+DP=2\s+×\s+TP=1\s+×\s+PP=1"):
        train(tmp_path / "one", "--num-rollout", "3", "--load", str(folder))


@pytest.mark.slow
@pytest.mark.parametrize("estimator", [
    # whitening over the whole batch and the adaptive KL controller reading the whole batch's KL (both summed over
    # ranks); the reference copy shares the policy's process groups
    ["reinforce_plus_plus", "--kl-coef", "0.01", "--kl-target", "0.01"],
    ["ppo"],  # the critic's gradients are averaged over the ranks too
], ids=["reinforce_plus_plus-kl", "ppo"])
def test_two_ranks_match_one_for_whole_batch_estimators(estimator, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo)")
    args = ["--num-rollout", "2", "--sft-steps", "2", "--eval-interval", "0", "--advantage-estimator", *estimator]
    single = train(tmp_path / "one", *args)
    if "--kl-target" in estimator:
        assert single[-1]["train/kl_coef"] != 0.01  # the controller moved
    else:
        assert single[-1]["train/value_loss"] > 0
    assert_same_records(single, train(tmp_path / "two", *args, ranks=2))


@pytest.mark.multigpu
def test_two_gpu_ranks_train_sync_and_resume(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (one per rank)")
    records = train(tmp_path, "--num-rollout", "4", "--save-interval", "2", ranks=2)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for record in records[1:]:
        assert 0 <= record["rollout/reward_mean"] <= 1
        assert torch.isfinite(torch.tensor([record["train/pg_loss"], record["train/grad_norm"]])).all()
    resumed = train(tmp_path / "resumed", "--num-rollout", "4", "--load", str(tmp_path / "checkpoints" / "rollout_1"),
                    ranks=2)
    assert [r["step"] for r in resumed] == [3, 4]
    assert resumed[0]["rollout/reward_mean"] == pytest.approx(records[3]["rollout/reward_mean"], abs=0.05)


def test_data_parallel_config_errors_name_the_flag(tmp_path):
    config = small_config(tmp_path)
    with pytest.raises(ConfigError, match="--rollout-batch-size 3 does not split over 2"):
        check_data_parallel(apply_overrides(config, {"rollout_batch_size": "3", "global_batch_size": "6"}), 2)
    # --no-colocate: rank 0 draws every rollout, so the SFT prompts must not come from the same stream
    with pytest.raises(ConfigError, match=r"--no-colocate with 2 data-parallel ranks: .*--sft-steps \d+.*give "
                                          r"--sft-prompt-data a file of its own"):
        check_data_parallel(apply_overrides(config, {"colocate": "false"}), 2)
    check_data_parallel(apply_overrides(config, {"colocate": "false", "sft_prompt_data": "sft.jsonl",
                                                 "rollout_batch_size": "4", "global_batch_size": "32"}), 2)


def test_distributed_timeout_is_checked_for_data_parallel_runs_too(tmp_path):
    config = apply_overrides(small_config(tmp_path), {"distributed_timeout_minutes": "0"})
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes must be > 0"):
        check_placement(config, 2)


def test_from_main_reports_any_rank0_error_on_every_rank(monkeypatch):
    """Rank 0's error, whatever its type, reaches the other ranks through the broadcast instead of leaving them
    waiting; the broadcast is replaced by a recorder (rank 0) and a replay of what it sent (rank 1)."""
    import torch.distributed as dist

    from redline.loop.data_parallel import DataParallel

    def make():
        raise PermissionError("cannot create the output folder")

    sent = []
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src, group, device: sent.append(list(box)))
    with pytest.raises(PermissionError, match="cannot create the output folder"):
        DataParallel(rank=0, world=2).from_main(make)

    def receive(box, src, group, device):
        box[:] = sent[0]

    monkeypatch.setattr(dist, "broadcast_object_list", receive)
    with pytest.raises(RuntimeError, match="^on rank 0: PermissionError: cannot create the output folder$"):
        DataParallel(rank=1, world=2).from_main(make)


def test_reduce_metrics_averages_same_keys_and_names_the_keys_ranks_do_not_share(tmp_path):
    import torch.multiprocessing as mp

    from tests.loop.dp_procs import reduce_metrics_worker  # importable by the spawned ranks

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(reduce_metrics_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        results = dict(results)
    expected_error = ("the ranks' step metrics differ; rank 0 alone has ['perf/sync_time']; "
                      "rank 1 alone has ['perf/gpu_util/offload_rollout']")
    for rank in (0, 1):
        same, error = results[rank]
        assert same == {"train/loss": 2.0, "perf/train_time": 4.0}  # the mean; a phase time takes the slowest rank
        assert error == expected_error


def test_global_batch_ids_take_each_ranks_slice_of_the_pool():
    from redline.loop.step import global_batch_ids

    # two ranks with 6 pooled samples each (rank 1's at 6..11), global batch 6 → 3 per rank per step
    assert global_batch_ids(0, 6, 6, 2) == [0, 1, 2, 6, 7, 8]
    assert global_batch_ids(1, 6, 6, 2) == [3, 4, 5, 9, 10, 11]
    assert global_batch_ids(1, 4, 8, 1) == [4, 5, 6, 7]


def test_exchange_samples_gives_each_rank_exactly_the_samples_it_trains_on(tmp_path):
    import torch.multiprocessing as mp

    from tests.loop.dp_procs import exchange_worker  # importable by the spawned ranks

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(exchange_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
        results = dict(results)
    assert results[0] == ({0: "r0s0", 4: "r1s1", 5: "r1s2"}, {"adv": {0: [0.0, 0.0], 4: [11.0, 11.0], 5: [12.0, 12.0]}})
    assert results[1] == ({1: "r0s1", 2: "r0s2", 3: "r1s0"}, {"adv": {1: [1.0, 1.0], 2: [2.0, 2.0], 3: [10.0, 10.0]}})


def test_deal_gives_every_rank_micro_batches_of_pooled_indices_within_the_budget():
    from redline.loop.step import deal

    lengths = [5, 9, 2, 7, 3, 8, 4, 6]  # by pooled index
    ids = [0, 1, 2, 4, 5, 6]
    per_rank = deal(lengths, ids, max_tokens=10, world=2)
    groups = [group for groups in per_rank for group in groups]
    assert len(per_rank[0]) == len(per_rank[1]) and sorted(i for g in groups for i in g) == ids
    assert all(sum(lengths[i] for i in group) <= 10 for group in groups)
