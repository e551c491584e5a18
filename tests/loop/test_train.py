"""`redline train` end to end on the built-in task: outputs, resume equality, NaN handling, the quickstart."""

import json
import math
from pathlib import Path

import pytest
import torch

from redline.config import RunConfig
from redline.configfile import apply_overrides, load_toml
from redline.loop.train import run

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
SMALL = {"num_rollout": "4", "rollout_batch_size": "5", "n_samples_per_prompt": "4", "global_batch_size": "20",
         "sft_steps": "3", "eval_interval": "2", "n_samples_per_eval_prompt": "1"}


def small_config(out: Path, **overrides) -> RunConfig:
    config = load_toml(RunConfig, QUICKSTART)
    return apply_overrides(config, {**SMALL, "output_dir": str(out), **overrides})


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert run(small_config(out, save_interval="2", save_hf=str(out / "hf"))) == 0
    return out


def test_run_writes_metrics_plots_report_and_tensorboard(finished_run):
    rows = records(finished_run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for key in ["rollout/reward_mean", "rollout/response_len_mean", "train/pg_loss", "train/kl", "train/entropy",
                "train/clipfrac", "train/grad_norm", "train/lr", "train/rollout_logprob_abs_diff",
                "perf/rollout_time", "perf/logprob_time", "perf/train_time", "perf/update_weights_time",
                "perf/offload_rollout_time", "perf/idle_time", "perf/step_time",
                "perf/tokens_per_gpu_per_sec", "perf/train_tflops"]:
        assert all(key in r and math.isfinite(r[key]) for r in rows[1:]), key
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2]
    for name in ["reward.png", "entropy.png", "phase_times.png", "report.md", "config.toml"]:  # kl: all 0, no plot
        assert (finished_run / name).is_file(), name
    assert any((finished_run / "tensorboard").iterdir())
    assert "Step-time breakdown, mean of steps 2–4" in (finished_run / "report.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU run")
def test_cpu_run_logs_no_gpu_telemetry(finished_run):
    assert not any(key.startswith("perf/gpu") for r in records(finished_run) for key in r)
    assert not (finished_run / "gpu_memory.png").exists()


@pytest.mark.gpu
def test_gpu_run_logs_gpu_telemetry_per_step(finished_run):
    for r in records(finished_run)[1:]:
        assert 0 <= r["perf/gpu_util"] <= 100 and r["perf/gpu_mem_gb"] > 0, r
        assert r["perf/gpu_power_w"] > 0 and r["perf/gpu_sm_clock_mhz"] > 0, r
    # memory is never zero on a GPU; utilisation can be, for this tiny model (then its plot is left out)
    assert (finished_run / "gpu_memory.png").is_file()
    assert "![gpu_memory](gpu_memory.png)" in (finished_run / "report.md").read_text()


def test_one_step_per_rollout_reuses_old_logprobs_exactly(finished_run):
    # the first (and only) optimizer step of each rollout sees the weights that produced its old log-probs
    assert all(r["train/approx_kl"] == 0.0 for r in records(finished_run)[1:])


def test_engine_logprobs_match_the_trainer(finished_run):
    assert all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in records(finished_run)[1:])


def test_hf_export_loads_in_transformers(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(finished_run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(finished_run / "hf")
    ids = torch.tensor([tokenizer("2+2=").input_ids])
    assert model(ids).logits.shape[-1] == model.config.vocab_size


def test_bf16_resume_takes_the_uninterrupted_runs_steps(tmp_path):
    """The fp32 master weights and moments are in the checkpoint: a bf16 run resumed from it takes the very steps
    of the run that went on."""
    whole = small_config(tmp_path / "whole", dtype="bfloat16", save_interval="2")
    assert run(whole) == 0
    resumed = small_config(tmp_path / "resumed", dtype="bfloat16",
                           load=str(tmp_path / "whole" / "checkpoints" / "rollout_1"))
    assert run(resumed) == 0
    original = {r["step"]: r for r in records(tmp_path / "whole")}
    for row in records(tmp_path / "resumed"):
        for key in ["rollout/reward_mean", "train/pg_loss", "train/entropy", "train/grad_norm"]:
            assert row[key] == original[row["step"]][key], (row["step"], key)


def test_resume_continues_the_same_trajectory(finished_run, tmp_path):
    config = small_config(tmp_path, load=str(finished_run / "checkpoints" / "rollout_1"))
    assert run(config) == 0
    original = {r["step"]: r for r in records(finished_run)}
    resumed = {r["step"]: r for r in records(tmp_path)}
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ["rollout/reward_mean", "rollout/response_len_mean", "train/pg_loss", "train/entropy",
                    "train/grad_norm"]:
            assert resumed[step][key] == pytest.approx(original[step][key], rel=1e-4, abs=1e-6), (step, key)


def test_nan_loss_skips_the_step_and_stops_after_max_bad_steps(tmp_path, monkeypatch):
    from redline.loop import worker

    def poisoned(self, batch, loss_cfg, *, reuse_old_logp):
        loss, metrics = original(self, batch, loss_cfg, reuse_old_logp=reuse_old_logp)
        return loss * float("nan"), metrics

    original = worker.TrainerWorker.policy_loss
    monkeypatch.setattr(worker.TrainerWorker, "policy_loss", poisoned)
    with pytest.raises(FloatingPointError, match=r"--max-bad-steps 1"):
        run(small_config(tmp_path, max_bad_steps="1", sft_steps="0", eval_interval="100"))
    rows = records(tmp_path)
    assert [r["train/skipped_steps"] for r in rows] == [1.0]


@pytest.mark.parametrize("setting", ["default", "0"])
def test_the_steps_run_with_the_start_ups_objects_frozen(tmp_path, monkeypatch, setting):
    import gc

    from redline.loop import train

    def counting(*args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return original(*args, **kwargs)

    original, frozen = train.rl_step, []
    monkeypatch.setattr(train, "rl_step", counting)
    if setting == "0":
        monkeypatch.setenv("REDLINE_GC_FREEZE", "0")
    assert run(small_config(tmp_path, num_rollout="2", sft_steps="0", eval_interval="100")) == 0
    assert len(frozen) == 2
    assert all(count > 10_000 for count in frozen) if setting == "default" else frozen == [0, 0]
    assert gc.get_freeze_count() == 0  # the run's model and data can be collected once it ends


def test_a_gc_freeze_switch_other_than_0_or_1_stops_the_run_at_start_up_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDLINE_GC_FREEZE", "off")
    assert run(small_config(tmp_path)) == 2
    assert "REDLINE_GC_FREEZE must be 0 or 1, got 'off'" in capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_configuration_errors_stop_before_any_model_loads(tmp_path, capsys):
    assert run(small_config(tmp_path, global_batch_size="7")) == 2
    assert "--global-batch-size (7)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quickstart_learns(tmp_path, dtype):
    """The README's main job: reward ≤ 0.3 after the SFT warm-up, ≥ 0.8 at the end (eval over every prompt); in
    bf16 too (fp32 master weights and moments)."""
    config = apply_overrides(load_toml(RunConfig, QUICKSTART), {"output_dir": str(tmp_path), "dtype": dtype})
    assert run(config) == 0
    evals = [r["eval/reward_mean"] for r in records(tmp_path) if "eval/reward_mean" in r]
    assert evals[0] <= 0.3
    assert evals[-1] >= 0.8


def test_streams_are_padded_to_the_backends_token_multiple(tmp_path):
    """FP8 backends need token counts divisible by 16; the padding must not change any real token's output."""
    from redline.loop.batching import pack
    from redline.loop.builtin import tiny_model
    from redline.loop.worker import _forward_hidden
    from redline.rollout.types import Sample
    from redline.trainer.models import from_pretrained

    model = from_pretrained(tiny_model(tmp_path / "m"), backend="bf16", dtype=torch.float32)
    samples = [Sample(prompt="p", tokens=[3, 4, 5, 6, 7], response_length=2, loss_mask=[1, 1]),
               Sample(prompt="p", tokens=[8, 9, 10], response_length=1, loss_mask=[1])]
    batch = pack(samples, [0, 1], {})
    unpadded = model(batch.input_ids, batch.cu_seqlens)
    model.backend.token_alignment = 16
    padded = _forward_hidden(model, batch)
    assert padded.shape == unpadded.shape
    torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-6)


def test_sft_loss_type_trains_on_labels(tmp_path):
    assert run(small_config(tmp_path, loss_type="sft", sft_steps="0", num_rollout="6", rollout_batch_size="5",
                            n_samples_per_prompt="4", global_batch_size="20", lr="3e-3")) == 0
    losses = [r["train/sft_loss"] for r in records(tmp_path)]
    assert len(losses) == 6 and losses[-1] < losses[0]


def test_ppo_trains_a_critic_and_resumes_it(tmp_path):
    config = small_config(tmp_path / "a", advantage_estimator="ppo", n_samples_per_prompt="1",
                          rollout_batch_size="20", global_batch_size="20", num_rollout="4", save_interval="2",
                          gamma="1.0", lambd="0.95")
    assert run(config) == 0
    rows = records(tmp_path / "a")[1:]
    assert all(math.isfinite(r["train/value_loss"]) for r in rows)
    resumed = small_config(tmp_path / "b", advantage_estimator="ppo", n_samples_per_prompt="1",
                           rollout_batch_size="20", global_batch_size="20", num_rollout="4", gamma="1.0",
                           lambd="0.95", load=str(tmp_path / "a" / "checkpoints" / "rollout_1"))
    assert run(resumed) == 0
    original = {r["step"]: r for r in records(tmp_path / "a")}
    for r in records(tmp_path / "b"):
        assert r["train/value_loss"] == pytest.approx(original[r["step"]]["train/value_loss"], rel=1e-4, abs=1e-6)


def test_critic_fits_fixed_returns(tmp_path):
    from redline.config import TrainConfig
    from redline.loop.batching import pack
    from redline.loop.builtin import tiny_model
    from redline.loop.critic import CriticWorker
    from redline.rollout.types import Sample
    from redline.trainer.models import from_pretrained

    decoder = from_pretrained(tiny_model(tmp_path / "m"), backend="bf16", dtype=torch.float32)
    critic = CriticWorker(decoder, TrainConfig(lr=1e-2), total_steps=30, value_clip=10.0, lr=1e-2)
    samples = [Sample(prompt="p", tokens=[3, 4, 5, 6, 7], response_length=3, loss_mask=[1, 1, 1]),
               Sample(prompt="p", tokens=[8, 9, 10], response_length=2, loss_mask=[1, 1])]
    returns = [torch.tensor([1.0, 0.5, 0.25]), torch.tensor([-1.0, -0.5])]
    zeros = [torch.zeros(3), torch.zeros(2)]
    batch = pack(samples, [0, 1], {"returns": returns, "old_values": zeros})
    assert torch.equal(critic.values(batch), torch.zeros(batch.num_tokens))  # zero-initialised head
    losses = [critic.step([batch], [1.0])["value_loss"] for _ in range(30)]
    expected_first = float(sum((r ** 2).sum() for r in returns) / 5)
    assert losses[0] == pytest.approx(expected_first)
    assert losses[-1] < 0.2 * losses[0]


def test_recompute_gives_the_same_run(tmp_path):
    plain = small_config(tmp_path / "plain", num_rollout="2", sft_steps="0", eval_interval="100")
    recomputed = small_config(tmp_path / "full", num_rollout="2", sft_steps="0", eval_interval="100",
                              recompute="full")
    assert run(plain) == 0 and run(recomputed) == 0
    for a, b in zip(records(tmp_path / "plain"), records(tmp_path / "full")):
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)


def test_evaluations_of_the_same_weights_draw_the_same_samples(tmp_path):
    """Eval draws are seeded per (prompt, draw): evaluating unchanged weights twice gives the same rewards."""
    from rich.console import Console

    from redline.loop.builtin import materialize
    from redline.loop.train import build

    config = small_config(tmp_path, n_samples_per_eval_prompt="2")
    config = apply_overrides(config, materialize(config, tmp_path / "builtin"))
    state, _ = build(config, Console(quiet=True))
    first, second = (state.loop.run_until_complete(state.rollout.evaluate(0)) for _ in range(2))
    state.loop.run_until_complete(state.engine.shutdown())
    assert 0 < first["eval/reward_mean"] < 1  # random weights with stochastic draws: a mix of right and wrong
    assert first == second


def test_logprob_gap_metric_measures_engine_vs_trainer(tmp_path):
    """train/rollout_logprob_abs_diff is the masked mean |trainer logp − engine logp| (reused-old-logp path)."""
    from redline.config import TrainConfig
    from redline.kernels import LossConfig
    from redline.loop.batching import pack
    from redline.loop.builtin import tiny_model
    from redline.loop.worker import TrainerWorker
    from redline.rollout.types import Sample
    from redline.trainer.models import from_pretrained

    model = from_pretrained(tiny_model(tmp_path / "m"), backend="bf16", dtype=torch.float32)
    worker = TrainerWorker(model, TrainConfig(), total_steps=1, temperature=1.0, keep_reference=False)
    samples = [Sample(prompt="p", tokens=[3, 4, 5, 6], response_length=2, loss_mask=[1, 1])]
    probe = pack(samples, [0], {})
    logp, _ = worker.logprobs(probe)
    engine_logp = logp[probe.loss_mask] + torch.tensor([0.1, -0.3])
    batch = pack(samples, [0], {"advantages": [torch.ones(2)], "rollout_logp": [engine_logp]})
    _, metrics = worker.policy_loss(batch, LossConfig(), reuse_old_logp=True)
    assert float(metrics["rollout_logprob_abs_diff"]) == pytest.approx(0.2, abs=1e-5)


@pytest.mark.gpu
def test_gpu_run_warms_up_kernels_before_the_first_step(finished_run):
    """The start-up warm-up's cost is in step 1's record; later steps compile no Triton kernel (step 1 may: an
    in-process embedded engine compiles its decode attention in the first rollout, which the warm-up leaves)."""
    rows = records(finished_run)[1:]
    assert rows[0]["perf/startup_compile_time"] > 0
    assert {"perf/startup_compile_count", "perf/startup_tuned_keys", "perf/compile_time"} <= rows[0].keys()
    assert [r["perf/compile_count"] for r in rows[1:]] == [0.0] * (len(rows) - 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU run")
def test_cpu_run_has_no_kernel_warmup(finished_run):
    # PyTorch kernels on the CPU: nothing is compiled, so nothing is warmed or clocked
    assert not any(key.startswith(("perf/compile", "perf/startup")) for r in records(finished_run) for key in r)
