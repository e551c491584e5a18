"""A run's folder over its life: exact records on resume, partial records, reuse, failed starts, Ctrl-C."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from redline.loop.metrics import MetricsLog, read_records
from redline.loop.train import run
from .test_train import QUICKSTART, records, small_config

QUICK = {"sft_steps": "0", "eval_interval": "100"}  # a run that only needs to exist


def tensorboard_scalars(out: Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


def test_resume_keeps_the_checkpoints_step_and_eval_and_purges_tensorboard(tmp_path):
    """Issue 22: resuming from rollout_1 (step 2, an eval step) deleted step 2's record; TensorBoard kept the
    stopped run's later steps beside the resumed run's."""
    out = tmp_path / "run"
    assert run(small_config(out, save_interval="2")) == 0
    assert run(small_config(out, load=str(out / "checkpoints" / "rollout_1"))) == 0
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "eval/reward_mean" in rows[2]
    logged = [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r]
    shown = tensorboard_scalars(out, "rollout/reward_mean")
    assert [s for s, _ in shown] == [s for s, _ in logged] == [1, 2, 3, 4]  # each step once
    assert [v for _, v in shown] == pytest.approx([v for _, v in logged])


def test_an_incomplete_last_record_is_dropped_with_a_warning(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 0.5}\n{"step": 2, "a": 0.')  # killed mid-append
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: dropped an incomplete last record"):
        log = MetricsLog(tmp_path, resume_step=5)
    log.close()
    assert log.records == [{"step": 1, "a": 0.5}]
    assert read_records(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 0.5}]


def test_a_bad_record_before_the_last_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_records(tmp_path / "metrics.jsonl")


def used_folder(out: Path) -> Path:
    """A folder as an earlier run leaves it (records and a checkpoint)."""
    (out / "checkpoints" / "rollout_0").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("rollout_0")
    (out / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    return out


def test_a_used_output_dir_is_refused(tmp_path, capsys):
    out = used_folder(tmp_path / "run")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert run(small_config(out, **QUICK)) == 2
    assert "holds a previous run" in capsys.readouterr().out
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # untouched


def test_overwrite_replaces_the_previous_run(tmp_path):
    out = used_folder(tmp_path / "run")
    assert run(small_config(out, num_rollout="1", overwrite="true", **QUICK)) == 0
    assert [r["step"] for r in records(out)] == [1]
    assert not (out / "checkpoints").exists()


def test_a_start_that_fails_validation_leaves_no_run_folder(tmp_path):
    out = tmp_path / "new"
    assert run(small_config(out, global_batch_size="7")) == 2
    assert not out.exists()
    out.mkdir()
    assert run(small_config(out, global_batch_size="7")) == 2
    assert list(out.iterdir()) == []


def test_a_start_that_fails_while_building_leaves_no_run_folder(tmp_path, monkeypatch):
    from redline.loop import train

    def fails(*args, **kwargs):
        raise ValueError("prompts.jsonl:3: the prompt is longer than the engine's context")

    monkeypatch.setattr(train, "build", fails)
    out = tmp_path / "new"
    with pytest.raises(ValueError, match="prompts.jsonl:3"):
        run(small_config(out))
    assert not out.exists()  # the next launch into it is not refused as "a previous run"


@pytest.mark.parametrize("engine", [[], ["--embedded-engine-process"]], ids=["in-process", "engine-process"])
def test_ctrl_c_stops_after_the_step_writes_the_report_and_prints_a_resume_command(tmp_path, engine):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "redline.cli", "train", str(QUICKSTART), "--output-dir", str(out),
               "--num-rollout", "500", "--rollout-batch-size", "5", "--n-samples-per-prompt", "4",
               "--global-batch-size", "20", "--sft-steps", "0", "--eval-interval", "1000", *engine]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and read_records(out / "metrics.jsonl")):
            assert child.poll() is None and time.monotonic() < deadline, child.stdout.read()
            time.sleep(0.2)
        os.killpg(child.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group, engine included
        output, _ = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 130, output
    assert "Traceback" not in output
    done = [r["step"] for r in records(out)]
    assert done == list(range(1, done[-1] + 1)) and done[-1] < 500
    assert (out / "report.md").is_file() and (out / "reward.png").is_file()
    assert f"stopped by Ctrl-C after step {done[-1]}" in (out / "report.md").read_text()
    assert (out / "checkpoints" / f"rollout_{done[-1] - 1}").is_dir()
    resume = output.split("resume with:")[1].strip().splitlines()[0]
    assert resume == f"redline train {out / 'config.toml'} --output-dir {out} --load {out}"
    # the printed command continues the run where it stopped (one more step here)
    args = shlex.split(resume)[1:] + ["--num-rollout", str(done[-1] + 1)]
    resumed = subprocess.run([sys.executable, "-m", "redline.cli", *args], capture_output=True, text=True,
                             env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [r["step"] for r in records(out)] == done + [done[-1] + 1]


def test_a_bad_load_into_a_used_folder_names_the_load_not_the_folder(tmp_path, capsys):
    out = used_folder(tmp_path / "run")
    assert run(small_config(out, load=str(out / "checkpoints" / "nowhere"), **QUICK)) == 2
    assert "no checkpoint there" in capsys.readouterr().out
