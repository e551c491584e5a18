"""``redline train`` under tensor / pipeline parallelism (gloo on the CPU): the group's weight stream and
pipeline log-probs against one process, then whole runs at TP=2 + SP, PP=2 and DP=2 × TP=2 against the
single-process run, and their resumes."""

import json
import os
import subprocess
import sys

import pytest
import torch

from redline.loop.builtin import tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def even_vocab_model(tmp_path_factory):
    """The quickstart's tiny model (its seed) with the vocabulary padded to a multiple of 2, as TP=2 gets it."""
    return tiny_model(tmp_path_factory.mktemp("model"), seed=7, vocab_multiple=2)


def test_group_stream_and_pipeline_logprobs_match_one_process(even_vocab_model, tmp_path):
    """TP=2 + SP × PP=2 over 4 gloo ranks: the leader receives every HF tensor in plan order, equal to the
    unsharded model's (one bucket spanning both stages, and small buckets); each stage's TP ranks see their
    stage's full tensors; the vocab-parallel log-probs through both stages equal one process's."""
    import torch.multiprocessing as mp

    from tests.loop.mp_procs import group_export_worker  # importable by the spawned ranks

    sizes = [2**30, 16 * 2**10]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(group_export_worker, args=(str(tmp_path / "store"), str(even_vocab_model), 2, 2, sizes, results),
                 nprocs=4, join=True)
        results = dict(results)
    leader_rank = 0  # tp fastest, then pp, dp outermost: rank 0 is TP rank 0 of the first stage
    for size in sizes:
        plans = {rank: results[rank]["plans"][size] for rank in results}
        names, plan_names, worst = plans[leader_rank]["leader"]
        assert names == plan_names and worst == 0.0
        assert all(plans[r]["leader"] is None and plans[r]["others_yielded"] == 0 for r in (1, 2, 3))
        stage_counts = [plans[r]["buckets"][1] for r in range(4)]
        assert stage_counts[0] == stage_counts[1] and stage_counts[2] == stage_counts[3]
        assert stage_counts[0] + stage_counts[2] == len(names)
        assert all(plans[r]["buckets"][0] == 0.0 for r in range(4))
    assert results[0]["plans"][2**30]["spanning"] == 1 and results[0]["plans"][16 * 2**10]["spanning"] == 0
    assert all(results[r]["logp"] < 1e-5 for r in range(4))


# the quickstart, short: 3 SFT steps, 3 RL steps of 2 optimizer steps each (so the old log-probs are a pass of
# their own) with a KL loss (reference log-probs), an eval at steps 0 and 2, a checkpoint after step 2
ARGS = ["examples/quickstart.toml", "--num-rollout", "3", "--sft-steps", "3", "--rollout-batch-size", "24",
        "--global-batch-size", "96", "--num-steps-per-rollout", "2", "--use-kl-loss", "--kl-loss-coef", "0.01",
        "--eval-interval", "2"]
LAYOUTS = {"tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
           "dp2-tp2-sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])}


def train(out, model, *args, processes: int = 1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
                if processes > 1 else [sys.executable])
    cmd = [*launcher, "-m", "redline.cli", "train", *ARGS, "--hf-checkpoint", str(model), "--output-dir", str(out),
           *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    crash = done.stderr.find("Fatal Python error")  # a rank's native abort: its threads' stacks (faulthandler)
    assert done.returncode == 0, done.stdout[-3000:] + (done.stderr[crash:crash + 6000] if crash >= 0 else "") \
        + done.stderr[-3000:]
    (out / "console.log").write_text(done.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_steps(expected, actual):
    """Same rewards and eval; losses and every other number within 1e-3 (fp32 sums in another order across
    ranks: the gradient norms differ in the 5th digit)."""
    assert [r["step"] for r in actual] == [r["step"] for r in expected]
    for want, got in zip(expected, actual):
        keys = sorted(k for k in want if not k.startswith("perf/"))
        assert keys == sorted(k for k in got if not k.startswith("perf/"))
        for key in keys:
            if key.startswith(("rollout/", "eval/")):  # the same samples (means over DP ranks up to rounding)
                assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-12), (want["step"], key)
            else:
                assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-3), (want["step"], key)


@pytest.fixture(scope="module")
def single_process(even_vocab_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return train(out, even_vocab_model, "--save-hf", str(out / "hf")), out


@pytest.mark.slow  # about 70 s a layout on 2 CPU cores (a run and its resume under torchrun), 4 minutes in all
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_run_takes_the_single_process_steps_and_resumes(layout, single_process, even_vocab_model,
                                                                 tmp_path):
    from safetensors.torch import load_file

    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo)")
    single, single_out = single_process
    processes, flags = LAYOUTS[layout]
    out = tmp_path / "run"
    records = train(out, even_vocab_model, *flags, "--save-interval", "2", "--save-hf", str(out / "hf"),
                    processes=processes)
    assert_same_steps(single, records)
    assert records[1]["train/kl"] > 0  # the reference pass ran through the parallel model
    exported = load_file(out / "hf" / "model.safetensors")
    expected = load_file(single_out / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(expected)
    for name in expected:  # Adam moves a weight whose gradient is ~0 by up to lr (2e-3) a step, whatever its sign's
        # ulps: sums in another order leave a few such elements 1e-4 apart after 9 steps, the rest within 1e-5
        torch.testing.assert_close(exported[name], expected[name], rtol=0, atol=1e-3, msg=name)
        assert (exported[name] - expected[name]).abs().mean() < 1e-5, name
    folder = out / "checkpoints" / "rollout_1"
    assert len(list(folder.glob("rank*.json"))) == processes  # each process's optimizer shard and data position
    resumed = train(tmp_path / "resumed", even_vocab_model, *flags, "--load", str(folder), processes=processes)
    assert_same_steps(records[-1:], resumed)


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_two_gpus_train_sync_and_resume_over_nccl(layout, even_vocab_model, tmp_path):
    """The same runs over NCCL, one GPU per rank: the trainer's log-probs of the engine's samples agree with the
    engine's (the weights the leader's engine received are the trainer's), and a resume continues."""
    import math

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (one per rank)")
    processes, flags = LAYOUTS[layout]
    records = train(tmp_path / "run", even_vocab_model, *flags, "--save-interval", "2", processes=processes)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[1:]:
        assert 0 <= record["rollout/reward_mean"] <= 1
        assert math.isfinite(record["train/loss"]) and math.isfinite(record["train/grad_norm"])
        assert record["train/rollout_logprob_abs_diff"] < 1e-2
    resumed = train(tmp_path / "resumed", even_vocab_model, *flags, "--load",
                    str(tmp_path / "run" / "checkpoints" / "rollout_1"), processes=processes)
    assert [r["step"] for r in resumed] == [3]


@pytest.mark.slow  # about 50 s on 2 CPU cores (a single-process run and a torchrun one)
def test_ppo_critic_under_tp_takes_the_single_process_steps(even_vocab_model, tmp_path):
    """The critic is the same TP-sharded model with a replicated value head: values, GAE and its steps match."""
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo)")
    args = ["--num-rollout", "2", "--eval-interval", "0", "--advantage-estimator", "ppo"]
    single = train(tmp_path / "one", even_vocab_model, *args)
    assert single[-1]["train/value_loss"] > 0
    parallel = train(tmp_path / "tp2", even_vocab_model, *args, *LAYOUTS["tp2-sp"][1], processes=2)
    assert_same_steps(single, parallel)
