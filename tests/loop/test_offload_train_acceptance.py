"""benchmarks/offload_train_acceptance.py end to end at the tiny model's size: both runs, the summary's rows."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_the_acceptance_script_runs_both_modes_and_summarises_them(tmp_path):
    out = tmp_path / "acceptance"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload_train_acceptance.py"), str(out),
                           "--shapes", "tiny", "--steps", "2", "--config", str(ROOT / "examples" / "quickstart.toml")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "summary.json").read_text())
    plain, offload = results["tiny-no-offload-train"], results["tiny-offload-train"]
    assert plain["ok"] and plain["medians"]["steps"] == 2 and plain["medians"]["perf/sync_time"] > 0
    assert plain["transition_s"] >= plain["medians"]["perf/sync_time"]
    if torch.cuda.is_available():
        assert offload["ok"] and offload["medians"]["perf/pause_train_time"] > 0
    else:  # refused at start-up, naming the flag and what is missing
        assert not offload["ok"] and "--offload-train" in offload["error"] and "CUDA GPU" in offload["error"]
    summary = (out / "summary.md").read_text()
    assert "| tiny-no-offload-train `--no-offload-train` | yes |" in summary


def acceptance_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("offload_train_acceptance",
                                                  ROOT / "benchmarks" / "offload_train_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_lists_each_groups_bytes_and_measured_pause_and_resume(tmp_path):
    acceptance = acceptance_module()
    log = ["training state (this rank):", acceptance.PLAN_TITLE,
           "| state | while the engine generates | released on the GPU | pinned host |",
           "| --- | --- | ---: | ---: |",
           "| master weights (fp32) | kept in pinned host memory | 6.41 GiB | 6.41 GiB |",
           "| all | | 6.41 GiB | 6.41 GiB |", "GPU telemetry: NVML every 0.1 s on cuda:0 (perf/gpu_*)"]
    plan = acceptance.plan_table(log)
    assert plan == log[2:6] and acceptance.plan_table(log[:1]) == []
    medians = {"perf/pause_train_masters_time": 0.25, "perf/resume_train_map_time": 0.5}
    results = {"s-offload-train": {"ok": True, "error": "", "flags": ["--offload-train"], "plan": plan,
                                   "medians": medians, "kv_cache_bytes": 0}}
    text = acceptance.summary(tmp_path, results)
    assert "| s-offload-train | – | 250.0 | – | – | – | 500.0 | – |" in text
    assert "| master weights (fp32) | kept in pinned host memory | 6.41 GiB | 6.41 GiB |" in text


def test_the_4b_shape_keeps_its_optimizer_state_in_pinned_host_memory_in_every_mode():
    assert "--optimizer-cpu-offload" in acceptance_module().SHAPE_FLAGS["qwen3-4b"]
    assert "qwen3-1.7b" not in acceptance_module().SHAPE_FLAGS


def test_a_colocated_sglang_run_reports_its_kv_cache_and_its_handling_against_the_update_phase(tmp_path):
    acceptance = acceptance_module()
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "sglang-30000.log").write_text("[2026-11-24 17:48:36] KV Cache is allocated. dtype: torch.bfloat16, "
                                           "#tokens: 750371, K size: 40.07 GB, V size: 40.07 GB\n")
    assert acceptance.sglang_kv_cache(tmp_path / "run") == {"tokens": 750371, "bytes": int(80.14 * 2**30)}
    assert acceptance.sglang_kv_cache(tmp_path) is None  # no server log: an embedded engine's run
    medians = {"perf/update_weights_time": 0.120, "perf/update_weights_sglang_time": 0.100,
               "perf/sync_time": 0.050, "perf/sync_sglang_time": 0.040}
    results = {"s-offload-train-auto": {"ok": True, "error": "", "flags": ["--offload-train"], "plan": [],
                                        "medians": medians, "kv_cache_bytes": 2**30, "kv_tokens": 750371}}
    text = acceptance.summary(tmp_path, results)
    assert "| s-offload-train-auto | 120.0 | 100.0 | 1.20× | 50.0 | 40.0 | 1.25× |" in text
    assert "| 1.00 | 750371 | – |" in text  # the engine's KV cache (GiB), its tokens, the step time


def test_an_unknown_mode_is_refused_naming_the_choices(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offload_train_acceptance.py"), str(tmp_path),
                           "--modes", "offload-train,fast"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "--modes: unknown ['fast']" in done.stderr and "offload-train-auto" in done.stderr


def test_the_sglang_acceptance_script_refuses_an_unknown_part_naming_the_parts(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "sglang_colocated_acceptance.sh"), str(tmp_path), "8b"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "part '8b' is not one of 1.7b, 4b-no-offload, 4b, 4b-keep-weights, all" in done.stderr
    assert not any(tmp_path.iterdir())  # nothing started
