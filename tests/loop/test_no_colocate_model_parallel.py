"""``--no-colocate`` beside a tensor- or pipeline-parallel trainer (gloo on the CPU): the group's leader broadcasts
the weights its export gathers into embedded engine processes of their own, which then hold the trainer's weights
bit for bit (an attached stand-in SGLang server: its hashes pass the check); whole runs at TP=2 + SP and PP=2 take
the single-process ``--no-colocate`` run's steps, also with ``--async-rollout one-step``, and ``full`` trains samples
of the pushed weights; the async runs resume. Each async schedule runs under one layout (one-step under TP=2 + SP,
full under PP=2): what the layouts change, the group's gathers and stages in a push, is the same code in every
schedule, and the synchronous runs take both layouts."""

import multiprocessing as mp

import pytest
import torch

from redline.loop.builtin import tiny_model
from tests.gloo_ranks import run_ranks
from tests.loop import no_colocate_procs  # importable by the spawned ranks

from .test_model_parallel import assert_same_steps, train

CTX = mp.get_context("spawn")  # not fork: the test process may hold threads (HTTP, gloo) of earlier tests
TIMEOUT_S = 180
NO_COLOCATE = no_colocate_procs.NO_COLOCATE
LAYOUTS = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}


@pytest.fixture(scope="module")
def even_vocab_model(tmp_path_factory):
    """The quickstart's tiny model (its seed) with the vocabulary padded to a multiple of 2, as TP=2 gets it."""
    return tiny_model(tmp_path_factory.mktemp("model"), seed=7, vocab_multiple=2)


def pushes(layout, model, engine_kind):
    """Each rank's outcome of ``no_colocate_procs.broadcast_from_parallel_trainer`` (a failed rank: its traceback
    raised here)."""
    outcome = run_ranks(CTX, no_colocate_procs.broadcast_from_parallel_trainer, 2,
                        lambda rank, port: (rank, port, str(model), layout, engine_kind), TIMEOUT_S, daemon=False)
    for rank in range(2):
        assert not isinstance(outcome[rank], str), outcome[rank]
    return outcome[0], outcome[1]


@pytest.mark.slow  # two gloo processes and an engine process
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_engine_process_holds_the_unsharded_trained_model_after_each_push(layout, even_vocab_model):
    leader, other = pushes(layout, even_vocab_model, "embedded")
    assert leader[1] == other[1] > 2  # the same plan on both ranks, several buckets
    assert "broadcast (gloo)" in leader[0] and "bucket checksums" in leader[0]  # checked on every push
    assert "gathers and sends its shards" in other[0]
    assert leader[2] == [0.0, 0.0]  # bit for bit, both pushes
    assert other[2] == []


@pytest.mark.slow  # two gloo processes and a stand-in server process
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_attached_sglang_server_passes_the_hash_check_after_each_push(layout, even_vocab_model):
    """The server's hashes of every tensor it received equal the unsharded trained model's (``verify_weights``
    raises ``WeightsMismatch`` otherwise); rank 1 gathers for the push and again for the check."""
    pytest.importorskip("aiohttp", reason="the SGLang client needs aiohttp")
    leader, other = pushes(layout, even_vocab_model, "sglang")
    assert "server hashes" in leader[0]
    assert leader[1] == other[1] > 2


@pytest.mark.slow  # about 40 s a layout on 2 CPU cores (torchrun's ranks and an engine process)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_no_colocate_run_takes_the_single_process_steps(layout, single_process_no_colocate,
                                                                 even_vocab_model, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo; engine processes on the CPU)")
    records = train(tmp_path / "run", even_vocab_model, *NO_COLOCATE, *LAYOUTS[layout], processes=2)
    console = (tmp_path / "run" / "console.log").read_text()
    assert "weight sync: broadcast (gloo)" in " ".join(console.split())  # rank 0's line, wrapped by the console
    assert_same_steps(single_process_no_colocate, records)
    for record in records[1:]:  # the engine sampled with the weights the trainer holds
        assert record["train/rollout_logprob_abs_diff"] < 1e-4


ONE_STEP = no_colocate_procs.ONE_STEP  # the group's ranks must agree on which step pushes


@pytest.mark.slow  # about 30 s on 2 CPU cores (a run and its resume under torchrun)
@pytest.mark.parametrize("layout", ["tp2-sp"])
def test_one_step_async_run_takes_the_single_process_steps_and_resumes(layout, single_process_one_step,
                                                                      even_vocab_model, tmp_path):
    """Rank 0 generates rollout k+1 while the group trains on rollout k; the checkpoint keeps that generated,
    untrained rollout and the resumed run trains it."""
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo; engine processes on the CPU)")
    out = tmp_path / "run"
    records = train(out, even_vocab_model, *NO_COLOCATE, *ONE_STEP, *LAYOUTS[layout], "--save-interval", "2",
                    processes=2)
    assert_same_steps(single_process_one_step, records)
    # rollouts 1 and 2 start before the first step push (after step 2, version 2): both generate with version 0
    assert [r["rollout/staleness_max"] for r in records[1:]] == [0.0, 1.0, 2.0]
    resumed = train(tmp_path / "resumed", even_vocab_model, *NO_COLOCATE, *ONE_STEP, *LAYOUTS[layout],
                    "--load", str(out / "checkpoints" / "rollout_1"), processes=2)
    assert_same_steps(records[-1:], resumed)


FULL = ["--async-rollout", "full", "--max-staleness", "0"]


@pytest.mark.slow  # about 30 s on 2 CPU cores (a run and its resume under torchrun)
@pytest.mark.parametrize("layout", ["pp2"])
def test_fully_async_run_trains_samples_of_the_pushed_weights_and_resumes(layout, even_vocab_model, tmp_path):
    """``--max-staleness 0``: every trained sample was generated wholly by the weights it trains (older and
    interrupted ones are dropped and generated again), so the trainer's log-probs of it are the engine's only if each
    push (rank 0 pausing the stream's requests) gave the engine the group's weights. A resumed run continues."""
    if torch.cuda.is_available():
        pytest.skip("the CPU variant (gloo; engine processes on the CPU)")
    out = tmp_path / "run"
    records = train(out, even_vocab_model, *NO_COLOCATE, *FULL, *LAYOUTS[layout], "--save-interval", "2",
                    processes=2)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[1:]:
        assert record["rollout/samples"] == 24 * 8 and record["rollout/staleness_max"] == 0  # 24 prompts × 8
        assert record["train/rollout_logprob_abs_diff/staleness_0"] < 1e-4
    resumed = train(tmp_path / "resumed", even_vocab_model, *NO_COLOCATE, *FULL, *LAYOUTS[layout], "--load",
                    str(out / "checkpoints" / "rollout_1"), processes=2)
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["rollout/samples"] == 24 * 8 and resumed[0]["rollout/staleness_max"] == 0
    assert resumed[0]["train/rollout_logprob_abs_diff/staleness_0"] < 1e-4
