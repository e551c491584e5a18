"""``--no-colocate`` under data parallelism (gloo on the CPU): rank 0's engine processes generate each whole batch,
whose groups are dealt to the DP ranks (group k to DP rank k mod DP); only DP rank 0's group pushes. A whole run at
DP=2 × TP=2 + SP takes the single-process ``--no-colocate`` run's steps (same rewards and evals, the rest within
1e-3), the engine samples with the weights the trainer holds after every push (each push's bucket checksums compared
on both sides), and a resume continues the same trajectory; so does a DP=2 ``--async-rollout one-step`` run (plain
DP=2), with the engines' clock rank 0's. A rollout that raises on rank 0 (also one generated ahead under one-step,
at a checkpoint) fails every rank at once, naming the error."""

import multiprocessing as mp

import pytest
import torch

from redline.loop.builtin import tiny_model
from tests.gloo_ranks import run_ranks
from tests.loop import no_colocate_procs  # importable by the spawned ranks

from .test_model_parallel import assert_same_steps, train

CTX = mp.get_context("spawn")
NO_COLOCATE, ONE_STEP = no_colocate_procs.NO_COLOCATE, no_colocate_procs.ONE_STEP
LAYOUTS = {"dp2-tp2-sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])}


def test_rank0s_batch_is_dealt_group_by_group_with_its_metrics():
    """Group k to DP rank k mod 2, in batch order; both ranks get rank 0's metrics, the counts on rank 0 alone (the
    step's reduction sums counts and averages the rest, so the logged record is rank 0's)."""
    outcome = run_ranks(CTX, no_colocate_procs.deal_rollout, 2, lambda rank, port: (rank, port), 60)
    assert not any(isinstance(v, str) for v in outcome.values()), outcome
    (groups0, indices0, metrics0), (groups1, indices1, metrics1) = outcome[0], outcome[1]
    assert groups0 == [0, 0, 2, 2] and indices0 == [0, 1, 4, 5]
    assert groups1 == [1, 1, 3, 3] and indices1 == [2, 3, 6, 7]
    assert metrics0 == {"rollout/reward_mean": 0.375, "rollout/samples": 8.0, "rollout/dropped_groups": 1.0}
    assert metrics1 == {"rollout/reward_mean": 0.375, "rollout/samples": 0.0, "rollout/dropped_groups": 0.0}


@pytest.mark.parametrize("where, world", [("rollout", 2), ("rollout", 4), ("checkpoint", 2)],
                         ids=["rollout-dp2", "rollout-dp2-tp2", "one-step-checkpoint-dp2"])
def test_a_rollout_that_raises_on_rank0_fails_every_rank_at_once_naming_its_error(where, world):
    """Rank 0 re-raises its own exception; every other rank raises at once naming rank 0 and the exception (a
    DP=2 × TP=2 group's other rank through its leader), instead of waiting until the process group's timeout (30 s
    here) and failing on it: in the step's rollout (the dealing's exchange), and with ``--async-rollout one-step``
    at a checkpoint taken while the next rollout had failed (the checkpoint's barrier)."""
    timeout_s = 30
    target = {"rollout": no_colocate_procs.failing_rollout,
              "checkpoint": no_colocate_procs.failed_rollout_ahead_at_checkpoint}[where]
    all_reported = CTX.Barrier(world)
    outcome = run_ranks(CTX, target, world, lambda rank, port: (rank, port, world, timeout_s, all_reported),
                        3 * timeout_s)
    assert not any(isinstance(v, str) for v in outcome.values()), outcome
    assert outcome[0][:2] == ("KeyError", "'reward exploded'")
    for rank in range(1, world):
        kind, message, _ = outcome[rank]
        assert kind == "RuntimeError" and "on rank 0: KeyError: 'reward exploded'" in message, (rank, message)
    assert all(seconds < timeout_s / 3 for _, _, seconds in outcome.values()), outcome


@pytest.fixture(scope="module")
def even_vocab_model(tmp_path_factory):
    """The quickstart's tiny model (its seed) with the vocabulary padded to a multiple of 2, as TP=2 gets it."""
    return tiny_model(tmp_path_factory.mktemp("model"), seed=7, vocab_multiple=2)


@pytest.mark.slow  # a run and its resume under torchrun, with an engine process: 45-60 s a layout on 2 CPU cores
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_data_parallel_no_colocate_run_takes_the_single_process_steps_and_resumes(
        layout, single_process_no_colocate, even_vocab_model, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo; engine processes on the CPU)")
    processes, flags = LAYOUTS[layout]
    out = tmp_path / "run"
    records = train(out, even_vocab_model, *NO_COLOCATE, *flags, "--save-interval", "2", processes=processes)
    console = " ".join((out / "console.log").read_text().split())  # rank 0's lines, wrapped by the console
    assert "driven by rank 0 for all 2 data-parallel ranks" in console
    assert "weight sync: broadcast (gloo)" in console and "bucket checksums" in console  # compared at every push
    assert_same_steps(single_process_no_colocate, records)
    for record in records[1:]:  # the engine sampled with the weights the trainer holds
        assert record["train/rollout_logprob_abs_diff"] < 1e-4
    resumed = train(tmp_path / "resumed", even_vocab_model, *NO_COLOCATE, *flags, "--load",
                    str(out / "checkpoints" / "rollout_1"), processes=processes)
    assert_same_steps(records[-1:], resumed)


@pytest.mark.slow  # a run and its resume under torchrun, with an engine process: about 60 s on 2 CPU cores
def test_one_step_async_data_parallel_run_takes_the_single_process_steps_and_resumes(
        single_process_one_step, even_vocab_model, tmp_path):
    """``--async-rollout one-step`` at DP=2: rank 0 generates rollout k+1 while both ranks train on their shares of
    rollout k; the ranks agree on which steps push (every second); the engine-side metrics are rank 0's; the
    checkpoint keeps the generated, untrained rollout (rank 0's) and the resumed run trains it."""
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo; engine processes on the CPU)")
    out = tmp_path / "run"
    records = train(out, even_vocab_model, *NO_COLOCATE, *ONE_STEP, "--save-interval", "2", processes=2)
    assert_same_steps(single_process_one_step, records)
    # rollouts 1 and 2 start before the first step push (after step 2, version 2): both generate with version 0
    assert [r["rollout/staleness_max"] for r in records[1:]] == [0.0, 1.0, 2.0]
    # the engines' busy and idle time are rank 0's clock's (rank 1's saw no generation: idle all its step)
    for record in records[1:]:
        assert record["perf/rollout_wait_time"] + record["perf/rollout_time"] <= record["perf/step_time"] + 1e-9
    assert all(r["perf/overlap_ratio"] > 0 for r in records[1:3])  # the next rollout generated while they trained
    resumed = train(tmp_path / "resumed", even_vocab_model, *NO_COLOCATE, *ONE_STEP, "--load",
                    str(out / "checkpoints" / "rollout_1"), processes=2)
    assert_same_steps(records[-1:], resumed)
