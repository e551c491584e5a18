"""The end-to-end benchmark (benchmarks/bench_e2e.py): its numbers from step records, redline's config and
metrics, and the whole benchmark at the tiny size on the CPU."""

import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmark's modules import each other by name, as when run as a script

from e2e_redline import config_toml, read_records  # noqa: E402
from e2e_workload import StepRecord, Workload, digit_share_of, summarize, write_prompts  # noqa: E402

from redline.config import RunConfig  # noqa: E402
from redline.configfile import load_toml  # noqa: E402


def record(step_time, train_time, util=None, mem=None, gen=100, trained=150):
    return StepRecord(step_time=step_time, train_time=train_time, generated_tokens=gen, trained_tokens=trained,
                      phases={"rollout": step_time - train_time, "train": train_time}, gpu_util=util, gpu_mem_gb=mem)


def test_summary_leaves_out_warmup_and_weights_idle_share_by_step_time():
    workload = Workload(warmup=1)
    records = [record(100.0, 50.0, util=0.0, mem=99.0), record(2.0, 1.0, util=90.0, mem=30.0),
               record(6.0, 3.0, util=50.0, mem=40.0)]
    s = summarize(records, workload, num_parameters=10**9, gpu_name="NVIDIA H100 80GB HBM3")
    assert s["steps"] == 2 and s["step_time_s"] == 4.0
    assert s["generated_tokens_per_s"] == 200 / 8 and s["trained_tokens_per_s"] == 300 / 8
    assert s["phases_s"] == {"rollout": 2.0, "train": 2.0}
    assert s["peak_gpu_mem_gb"] == 40.0
    assert s["train_tflops"] == pytest.approx(6e9 * 300 / 4.0 / 1e12)
    assert s["train_mfu"] == pytest.approx(s["train_tflops"] / 989.4)
    assert s["gpu_idle_share"] == pytest.approx(1 - (90 * 2 + 50 * 6) / 8 / 100)


def test_summary_charges_idle_seconds_to_the_phases_that_report_utilisation():
    records = [record(4.0, 1.0), record(4.0, 1.0), record(8.0, 2.0)]
    records[1].phase_gpu_util = {"rollout": 80.0, "train": 100.0}
    records[2].phase_gpu_util = {"rollout": 50.0}
    s = summarize(records, Workload(warmup=1), num_parameters=10)
    assert s["gpu_idle_by_phase_s"] == pytest.approx({"rollout": (3.0 * 0.2 + 6.0 * 0.5) / 2, "train": 0.0})


def test_summary_without_telemetry_or_a_known_board_leaves_those_out():
    s = summarize([record(1.0, 0.5), record(1.0, 0.5)], Workload(warmup=1), num_parameters=10, gpu_name=None)
    assert s["train_mfu"] is None and s["gpu_idle_share"] is None and s["peak_gpu_mem_gb"] is None


def test_summary_needs_a_step_past_warmup():
    with pytest.raises(ValueError, match="none past the 2 warm-up steps"):
        summarize([record(1.0, 0.5)] * 2, Workload(warmup=2), num_parameters=10)


def test_every_prompt_has_the_workload_length(tmp_path):
    workload = Workload(prompts=3, prompt_len=20, steps=2, warmup=1)
    rows = [json.loads(line) for line in write_prompts(tmp_path / "p.jsonl", workload).read_text().splitlines()]
    assert len(rows) == 9 and all(len(r["prompt"]) == 20 for r in rows)


def test_reward_is_the_share_of_digits():
    assert digit_share_of("a1b2") == 0.5 and digit_share_of("") == 0.0


def test_redline_config_is_the_workload(tmp_path):
    workload = Workload()
    path = tmp_path / "run.toml"
    path.write_text(config_toml(workload, model_dir=tmp_path / "model", prompts=tmp_path / "p.jsonl",
                                engine="sglang", max_tokens_per_gpu=16384, sglang_mem_fraction=0.45,
                                offload_rollout=True))
    config = load_toml(RunConfig, path)
    r = config.rollout
    assert (r.rollout_engine, r.rollout_batch_size, r.n_samples_per_prompt) == ("sglang", 64, 8)
    assert r.rollout_max_response_len == 1024 and r.rollout_ignore_eos and r.num_rollout == 12
    assert config.train.global_batch_size == 512 and config.train.num_steps_per_rollout == 1
    assert config.train.lr == 1e-6 and config.model.dtype == "bfloat16" and config.model.backend == "bf16"
    assert config.algo.advantage_estimator == "grpo" and config.sync.offload_rollout
    assert r.sglang_mem_fraction_static == 0.45 and config.data.rollout_max_prompt_len == 128
    path.write_text(config_toml(workload, model_dir=tmp_path / "model", prompts=tmp_path / "p.jsonl",
                                engine="sglang", max_tokens_per_gpu=16384, sglang_mem_fraction=None,
                                offload_rollout=True))
    assert load_toml(RunConfig, path).rollout.sglang_mem_fraction_static is None  # the loop's own sizing


def test_redline_metrics_become_step_records(tmp_path):
    workload = Workload(prompts=2, samples=4)
    rows = [{"step": 0, "sft/loss": 1.0},
            {"step": 1, "perf/step_time": 3.0, "perf/train_time": 1.0, "perf/rollout_time": 1.5,
             "perf/idle_time": 0.5, "perf/tokens_per_gpu_per_sec": 800.0, "rollout/response_len_mean": 64.0,
             "perf/gpu_util": 70.0, "perf/gpu_mem_gb": 20.0, "perf/gpu_util/rollout": 60.0, "perf/gpu_util/train": 95.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    [rec] = read_records(path, workload)
    assert rec.generated_tokens == 8 * 64 and rec.trained_tokens == 800
    assert rec.phases == {"rollout": 1.5, "train": 1.0, "idle": 0.5}
    assert (rec.gpu_util, rec.gpu_mem_gb, rec.response_len_mean) == (70.0, 20.0, 64.0)
    assert rec.phase_gpu_util == {"rollout": 60.0, "train": 95.0}


@pytest.fixture(scope="module")
def tiny_bench():
    import bench_e2e

    return bench_e2e


def test_tiny_benchmark_runs_redline_to_fixed_length_responses(tiny_bench, tmp_path):
    assert tiny_bench.main([str(tmp_path), "--tiny", "--trainers", "redline-embedded,redline-sglang",
                            "--model-cache", str(tmp_path / "models")]) == 0
    result = json.loads((tmp_path / "tiny" / "redline-embedded.json").read_text())
    assert result["error"] is None
    s = result["summary"]
    workload = Workload(**result["workload"])
    assert s["steps"] == workload.steps and s["response_len_mean"] == workload.response_len
    assert s["generated_tokens_per_s"] == pytest.approx(
        workload.samples_per_step * workload.response_len / s["step_time_s"])
    assert set(s["phases_s"]) == {"rollout", "offload", "logprob", "train", "weight_sync", "idle"}
    assert sum(s["phases_s"].values()) == pytest.approx(s["step_time_s"])
    report = (tmp_path / "e2e.md").read_text()
    assert "| redline-embedded |" in report and (tmp_path / "e2e.png").is_file()
    skipped = json.loads((tmp_path / "tiny" / "redline-sglang.json").read_text())
    assert "skipped" in skipped or "summary" in skipped  # run where SGLang and a GPU are there
    combined = json.loads((tmp_path / "e2e.json").read_text())
    assert {r["trainer"] for r in combined["results"]} == {"redline-embedded", "redline-sglang"}
    assert combined["environment"]["software"]["torch"]


@pytest.mark.slow
def test_tiny_benchmark_runs_trl(tiny_bench, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
    assert tiny_bench.main([str(tmp_path), "--tiny", "--trainers", "trl", "--steps", "1",
                            "--model-cache", str(tmp_path / "models")]) == 0
    result = json.loads((tmp_path / "tiny" / "trl.json").read_text())
    assert result["error"] is None, result["error"]
    workload = Workload(**result["workload"])
    [measured] = result["records"][workload.warmup:]
    assert measured["response_len_mean"] == workload.response_len  # min_new_tokens holds every response
    assert measured["trained_tokens"] == workload.samples_per_step * (workload.prompt_len + workload.response_len)
    assert set(result["summary"]["phases_s"]) == {"generate", "score", "train"}
    assert result["settings"]["generation_batch_size"] == workload.samples_per_step


def test_trl_spec_generates_with_transformers_at_fixed_length(tiny_bench, tmp_path):
    import e2e_trl

    args = tiny_bench.parser().parse_args([str(tmp_path)])
    workload = Workload()
    spec = tiny_bench.trl_spec("trl", workload, tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "r.json", args)
    settings = e2e_trl.grpo_settings(spec, cuda=True)
    assert "vllm" not in spec and "use_vllm" not in settings
    assert settings["generation_kwargs"] == {"min_new_tokens": 1024} and settings["bf16"]
    assert settings["gradient_accumulation_steps"] * settings["per_device_train_batch_size"] == 512


def test_trl_vllm_spec_colocates_vllm_with_the_memory_share(tiny_bench, tmp_path):
    import e2e_trl

    args = tiny_bench.parser().parse_args([str(tmp_path), "--trl-vllm-gpu-memory-utilization", "0.6"])
    workload = Workload()
    spec = tiny_bench.trl_spec("trl-vllm", workload, tmp_path / "model", tmp_path / "p.jsonl", tmp_path / "r.json",
                               args)
    settings = e2e_trl.grpo_settings(spec, cuda=True)
    assert (settings["use_vllm"], settings["vllm_mode"], settings["vllm_gpu_memory_utilization"]) == (
        True, "colocate", 0.6)
    assert settings["vllm_max_model_length"] == 128 + 1024
    assert settings["generation_kwargs"] == {"min_tokens": 1024}  # vLLM's SamplingParams name for min_new_tokens
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")
    config = trl.GRPOConfig(**(e2e_trl.grpo_settings(spec, cuda=False) | {"output_dir": str(tmp_path / "trl")}))
    assert config.use_vllm and config.vllm_mode == "colocate" and config.vllm_gpu_memory_utilization == 0.6
    assert config.generation_batch_size == workload.samples_per_step  # one vLLM round of 512 per optimizer step


def test_trl_vllm_is_skipped_with_the_reason_when_vllm_does_not_import(tiny_bench, tmp_path):
    from redline.extras import available

    if available("vllm"):
        pytest.skip("vLLM is installed here")
    assert tiny_bench.main([str(tmp_path), "--tiny", "--trainers", "trl-vllm",
                            "--model-cache", str(tmp_path / "models")]) == 0
    skipped = json.loads((tmp_path / "tiny" / "trl-vllm.json").read_text())["skipped"]
    assert "vLLM does not import" in skipped and "No module named 'vllm'" in skipped
    assert "stage_peers.py vllm" in skipped
    assert f"| trl-vllm | — | — | — | — | — | {skipped} |" in (tmp_path / "e2e.md").read_text()


def test_cli_entry_runs_the_benchmark_script(tmp_path):
    from click.testing import CliRunner

    from redline.cli import main

    result = CliRunner().invoke(main, ["bench", "e2e", str(tmp_path), "--report-only"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "e2e.json").read_text())["results"] == []
    assert (tmp_path / "e2e.md").read_text().startswith("# End-to-end GRPO benchmark")


@pytest.mark.parametrize("flags,message", [
    (["--redline-args", "--lr '1e-6"], "--redline-args \"--lr '1e-6\": No closing quotation"),
    (["--trl-vllm-gpu-memory-utilization", "1.5"], "--trl-vllm-gpu-memory-utilization must be in \\(0, 1\\], got 1.5"),
])
def test_bad_flags_are_refused_naming_them_before_anything_runs(tiny_bench, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        tiny_bench.main([str(tmp_path / "out"), "--tiny", *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out" / "tiny").exists()  # nothing ran
