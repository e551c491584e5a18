"""The GPU acceptance script of issue 17 (benchmarks/parallel_acceptance.py) on the CPU: its plan, the launches it
generates (parsed by the real ``redline train`` CLI), its argument checks and its summary of metrics.jsonl files."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import parallel_acceptance as acceptance


def test_two_gpus_plan_a_colocated_tp2_engine_and_the_scaling_slice():
    runs = {r.name: r for r in acceptance.plan_runs(2, "sglang")}
    assert set(runs) == {"tp2-sp-sglang2", "slice-tp1", "slice-tp2-sp", "slice-pp2"}
    tp2 = runs["tp2-sp-sglang2"]
    assert (tp2.gpus, tp2.tp, tp2.pp, tp2.sp, tp2.gpus_per_engine, tp2.model) == (2, 2, 1, True, 2, "full")
    assert all(runs[n].model == "slice" and runs[n].role == "scaling" for n in ("slice-tp1", "slice-tp2-sp",
                                                                                  "slice-pp2"))


def test_four_gpus_add_tp4_and_pp2():
    runs = {r.name: r for r in acceptance.plan_runs(4, "sglang")}
    assert (runs["tp4-sp-sglang4"].tp, runs["tp4-sp-sglang4"].gpus_per_engine) == (4, 4)
    pp = runs["pp2-tp2-sp-sglang4"]  # one engine over the whole model-parallel group
    assert (pp.gpus, pp.tp, pp.pp, pp.gpus_per_engine) == (4, 2, 2, 4)
    assert runs["slice-tp4-sp"].gpus == 4 and runs["slice-pp2"].gpus_per_engine == 2


def test_without_sglang_every_engine_takes_one_gpu():
    assert {r.gpus_per_engine for r in acceptance.plan_runs(4, "embedded")} == {1}


def test_dry_run_writes_launches_the_cli_accepts(tmp_path):
    assert acceptance.main([str(tmp_path), "--dry-run", "--gpus", "4", "--engine", "sglang", "--steps", "3"]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["gpus"] == 4 and plan["engine"] == "sglang" and len(plan["runs"]) == 7
    for run in plan["runs"]:
        argv = run["command"]
        assert f"--nproc-per-node={run['gpus']}" in argv and argv[argv.index("-m", 3) + 1] == "redline.cli"
        config = acceptance.check_command(argv)  # the real click command parses it onto the base config
        p = config["parallel"]
        assert (p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"], p["sequence_parallel"],
                p["rollout_num_gpus_per_engine"]) == (run["tp"], run["pp"], run["sp"], run["gpus_per_engine"])
        assert config["rollout"]["rollout_engine"] == "sglang" and config["rollout"]["num_rollout"] == 3
        assert config["checkpoint"]["output_dir"] == str(tmp_path / run["name"])
        model = "qwen3-8b" if run["model"] == "full" else "qwen3-8b-8-layers"
        assert config["model"]["hf_checkpoint"] == str(tmp_path / "models" / model)
        assert config["sync"]["offload_rollout"] is True  # the base example's colocated transition


def test_an_unknown_extra_flag_stops_the_dry_run(tmp_path):
    with pytest.raises(Exception, match="no-such-flag"):
        acceptance.main([str(tmp_path), "--dry-run", "--gpus", "2", "--extra", "--no-such-flag 1"])


@pytest.mark.parametrize("argv,message", [(["--gpus", "3"], "--gpus must be 2 or 4"),
                                          (["--steps", "1"], "--steps must be >= 2"),
                                          (["--slice-layers", "0"], "--slice-layers must be >= 1"),
                                          (["--profile", "--steps", "2"], "--profile needs --steps >= 3")])
def test_bad_arguments_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        acceptance.parse_args([str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_only_refuses_a_run_that_is_not_planned(tmp_path):
    with pytest.raises(SystemExit, match="slice-tp4-sp"):
        acceptance.main([str(tmp_path), "--dry-run", "--gpus", "2", "--only", "slice-tp4-sp"])


def write_metrics(path, train_times, mem=None):
    path.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "perf/step_time": 3 * t, "perf/train_time": t,
                         "train/rollout_logprob_abs_diff": 0.01 * (i + 1),
                         **({"perf/gpu_mem_gb": mem + i} if mem is not None else {})})
             for i, t in enumerate(train_times)]
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_summary_takes_medians_after_the_first_step_and_the_memory_peak(tmp_path):
    write_metrics(tmp_path / "r", [9.0, 1.0, 3.0, 2.0], mem=40.0)
    summary = acceptance.summarize_run(acceptance.read_metrics(tmp_path / "r" / "metrics.jsonl"))
    assert summary["steps"] == 4
    assert summary["phases"]["perf/train_time"] == {"median_s": 2.0, "step1_s": 9.0}
    assert summary["phases"]["perf/step_time"]["median_s"] == 6.0
    assert summary["gpu_mem_gb_max"] == 43.0
    assert summary["logprob_gap_max"] == pytest.approx(0.04)


def test_summary_leaves_the_profiled_step_out(tmp_path):
    write_metrics(tmp_path / "r", [9.0, 1.0, 3.0, 20.0])
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    lines[-1] = json.dumps({**json.loads(lines[-1]), "perf/profiled": 1.0})
    (tmp_path / "r" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = acceptance.summarize_run(acceptance.read_metrics(tmp_path / "r" / "metrics.jsonl"))
    assert summary["phases"]["perf/train_time"]["median_s"] == 2.0  # of 1.0 and 3.0; the traced 20.0 left out


def test_profile_traces_the_last_step_of_every_launch(tmp_path):
    assert acceptance.main([str(tmp_path), "--dry-run", "--gpus", "2", "--steps", "5", "--profile"]) == 0
    for run in json.loads((tmp_path / "plan.json").read_text())["runs"]:
        config = acceptance.check_command(run["command"])  # parsed by the real CLI
        assert config["profile"] == {"use_pytorch_profiler": True, "profile_step_start": 5, "profile_step_end": 6}


def test_scaling_efficiency_is_the_tp1_time_over_gpus_times_the_parallel_time(tmp_path):
    runs = acceptance.plan_runs(2, "sglang")
    times = {"slice-tp1": [5.0, 2.0, 2.0], "slice-tp2-sp": [5.0, 1.1, 1.1], "slice-pp2": [5.0, 1.25, 1.25]}
    results = {}
    for name, series in times.items():
        write_metrics(tmp_path / name, series)
        results[name] = {"summary": acceptance.summarize_run(acceptance.read_metrics(tmp_path / name /
                                                                                    "metrics.jsonl"))}
    scaling = acceptance.scaling(results, runs)
    assert scaling["slice-tp2-sp"]["scaling_efficiency"] == pytest.approx(2.0 / (2 * 1.1))
    assert scaling["slice-tp2-sp"]["meets_target"] is True
    assert scaling["slice-pp2"]["scaling_efficiency"] == pytest.approx(0.8)
    assert scaling["slice-pp2"]["meets_target"] is False
    report = {"device": "H200", "gpus": 2, "engine": "embedded", "commit": "abc", "model": "qwen3-8b",
              "scaling": scaling,
              "runs": {name: {"run": {"gpus": 1, "tp": 1, "pp": 1, "sp": False, "gpus_per_engine": 1},
                              "status": "ok", **results[name]} for name in times}}
    text = acceptance.markdown(report)
    assert "| slice-pp2 | 2 | 1.250 | 2.000 | 80.0% | MISSED |" in text
    # the per-run row: phase medians with step 1 in brackets, no memory sampled, the largest log-prob gap
    assert "| slice-tp1 | 1 | 1 | 1 | no | 1 | ok | 6.000 (15.000) | — | — | 2.000 (5.000) |" in text
    assert text.count("| — | 0.0300 |") == 3
    assert "NOT measured" in text  # no SGLang: the summary says the multi-GPU engine did not run


@pytest.mark.slow  # a torchrun launch of two gloo ranks (~40 s on the CPU machine)
def test_the_script_runs_end_to_end_on_the_cpu_at_a_tiny_size(tmp_path):
    code = acceptance.main([str(tmp_path), "--cpu", "--model", "tiny", "--base-config",
                            str(acceptance.REPO / "examples" / "quickstart.toml"), "--dtype", "float32",
                            "--steps", "3", "--profile", "--no-scaling", "--extra",
                            "--rollout-batch-size 4 --global-batch-size 32 --sft-steps 0 --eval-interval 0"])
    report = json.loads((tmp_path / "acceptance.json").read_text())
    [(name, result)] = report["runs"].items()
    assert code == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    assert name == "tp2-sp-embedded1" and result["status"] == "ok"
    summary = result["summary"]
    assert summary["steps"] == 3 and summary["phases"]["perf/train_time"]["median_s"] > 0
    for rank in (0, 1):  # each torchrun process traced step 3 (no GPU here: phases without device work)
        traced = json.loads((tmp_path / name / "profile" / f"rank{rank}" / "summary.json").read_text())
        assert traced["profiled_steps"] == [3] and traced["phases"]["train"]["wall_s"] > 0
    assert summary["logprob_gap_max"] is not None
    assert "| tp2-sp-embedded1 | 2 | 2 | 1 | yes | 1 | ok |" in (tmp_path / "acceptance.md").read_text()


def test_the_report_covers_runs_of_earlier_invocations(tmp_path):
    # runs launched one at a time (--only) leave OUT/<run>.result.json; --report-only rebuilds the whole report
    for name, series in {"slice-tp1": [5.0, 2.0, 2.0], "slice-tp2-sp": [5.0, 1.0, 1.0]}.items():
        write_metrics(tmp_path / name, series)
        run = next(r for r in acceptance.plan_runs(2, "sglang") if r.name == name)
        summary = acceptance.summarize_run(acceptance.read_metrics(tmp_path / name / "metrics.jsonl"))
        (tmp_path / f"{name}.result.json").write_text(json.dumps(
            {"run": acceptance.asdict(run), "command": [], "status": "ok", "wall_s": 1.0, "summary": summary}))
    code = acceptance.main([str(tmp_path), "--report-only", "--gpus", "2", "--engine", "sglang"])
    report = json.loads((tmp_path / "acceptance.json").read_text())
    assert code == 0 and set(report["runs"]) == {"slice-tp1", "slice-tp2-sp"}
    assert report["scaling"]["slice-tp2-sp"]["scaling_efficiency"] == pytest.approx(1.0)
    assert report["missing"] == ["tp2-sp-sglang2", "slice-pp2"]
    assert "Not run yet (in this folder): tp2-sp-sglang2, slice-pp2." in (tmp_path / "acceptance.md").read_text()
