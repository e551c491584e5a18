"""What a user sees of a run (issue 22): the console (progress, eval lines, warnings, summary), report.md and its
plots, greedy rollouts, built-in data names anywhere, skipped records."""

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from redline.config import RunConfig
from redline.configfile import apply_overrides, load_toml
from redline.loop.builtin import materialize
from redline.loop.health import RunHealth
from redline.loop.metrics import PLOT_AXES, PLOTS
from redline.loop.progress import RunProgress, summary
from redline.loop.train import run

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
ONE_STEP = {"num_rollout": "1", "rollout_batch_size": "5", "n_samples_per_prompt": "4", "global_batch_size": "20",
            "sft_steps": "0", "eval_interval": "100", "n_samples_per_eval_prompt": "1"}


def config_for(out: Path, **overrides) -> RunConfig:
    return apply_overrides(load_toml(RunConfig, QUICKSTART), {**ONE_STEP, "output_dir": str(out), **overrides})


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_capturing(config) -> tuple[int, str]:
    """Run with the console going to a string (not a terminal, like a log file)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = run(config)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def collapsed_run(tmp_path_factory):
    """--lr 1e3 on the quickstart: within a few steps every gradient is zero and the entropy is log(vocab)."""
    out = tmp_path_factory.mktemp("collapsed")
    code, console = run_capturing(config_for(out, lr="1e3", num_rollout="6", eval_interval="3"))
    assert code == 0
    return out, console


def test_a_collapsed_run_warns_in_the_console_and_the_report(collapsed_run):
    out, console = collapsed_run
    assert "WARNING steps" in console and "every gradient is zero" in console
    assert "is that of a uniform distribution over the vocabulary" in console
    report = (out / "report.md").read_text()
    assert "**WARNING** steps" in report and "every gradient is zero" in report


def test_a_log_file_gets_one_unwrapped_line_per_step(collapsed_run):
    _, console = collapsed_run
    steps = [line for line in console.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in steps] == [f"[{i}/6" for i in range(1, 7)]
    assert all(len(line) > 80 and "idle" in line for line in steps)  # longer than the 80 columns, not wrapped
    assert "\r" not in console and "\x1b[" not in console  # nothing that redraws


def test_evaluations_are_printed_when_computed_and_the_run_ends_with_a_summary(collapsed_run):
    out, console = collapsed_run
    lines = console.splitlines()
    evals = [i for i, line in enumerate(lines) if line.startswith("eval at step ")]
    assert [lines[i].split(":")[0] for i in evals] == ["eval at step 3", "eval at step 6"]
    assert "reward_mean" in lines[evals[0]] and "pass@1" in lines[evals[0]]
    done = next(line for line in lines if line.startswith("done: "))
    evaluated = [r["eval/reward_mean"] for r in records(out) if "eval/reward_mean" in r]
    first, last = evaluated[0], evaluated[-1]
    assert done.startswith("done: 6 RL steps in ")
    assert f"eval reward {first:.3f} (step 3) → {last:.3f} (step 6)" in done
    assert f"report {out / 'report.md'}" in done


def test_report_has_no_doubled_eval_keys_and_no_plot_of_a_zero_metric(collapsed_run):
    out, _ = collapsed_run
    report = (out / "report.md").read_text()
    assert "eval/eval/" not in report and "| eval/reward_mean |" in report
    assert not any(key.startswith("eval/eval/") for r in records(out) for key in r)
    assert all(r["train/kl"] == 0 and r["train/approx_kl"] == 0 for r in records(out))
    assert not (out / "kl.png").exists() and "![kl]" not in report  # identically zero: nothing to see
    assert (out / "reward.png").is_file() and (out / "entropy.png").is_file()


def test_every_plot_has_a_title_and_a_unit():
    assert set(PLOT_AXES) == set(PLOTS)
    assert all(title and unit for title, unit in PLOT_AXES.values())


def test_health_warns_once_per_streak_of_patience_steps():
    health = RunHealth(vocab_size=19, patience=3)
    uniform = math.log(19)
    steps = [(0.5, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, uniform), (0.0, uniform), (0.2, uniform), (0.3, 1.0)]
    raised = {step: health.observe(step, {"train/grad_norm": g, "train/entropy": e})
              for step, (g, e) in enumerate(steps, start=1)}
    assert [s for s, w in raised.items() if w] == [4, 6]
    assert "steps 2-4: every gradient is zero" in raised[4][0]
    assert "steps 4-6: the policy's entropy" in raised[6][0]
    assert health.warnings == raised[4] + raised[6]


def test_a_terminal_gets_a_live_bar_with_eta_and_phase():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=150)
    with RunProgress(console, total=4) as progress:
        progress.begin(1)
        progress.phase("train")
        progress.live.refresh()
        progress.step("[2/4] reward 0.5")
    text = screen.getvalue()
    assert "RL steps" in text and "eta" in text and "· train" in text and "2/4" in text
    assert "[2/4] reward 0.5" in text


def test_summary_without_evaluations():
    assert summary([{"step": 1}], 1, 2.0, "r.md") == "done: 1 RL steps in 2.0 s · report r.md"


def test_temperature_zero_runs_greedy(tmp_path):
    """Greedy rollouts: every sample of a group is the same response; the trainer's log-probs (taken at
    temperature 1, as the engine reports them for greedy draws) match the engine's."""
    code, _ = run_capturing(config_for(tmp_path, rollout_temperature="0", num_rollout="2"))
    assert code == 0
    rows = records(tmp_path)
    assert all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in rows)


def test_builtin_eval_data_beside_ones_own_prompt_data(tmp_path):
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    config = config_for(tmp_path, prompt_data=str(own), eval_prompt_data="builtin:addition",
                        sft_prompt_data="builtin:addition")
    overrides = materialize(config, tmp_path / "builtin")
    assert "prompt_data" not in overrides
    assert Path(overrides["eval_prompt_data"]).name == "eval.jsonl" and Path(overrides["eval_prompt_data"]).is_file()
    assert Path(overrides["sft_prompt_data"]).name == "sft.jsonl"
    with pytest.raises(ValueError, match="--eval-prompt-data builtin:nope: unknown built-in task"):
        materialize(config_for(tmp_path, eval_prompt_data="builtin:nope"), tmp_path / "builtin")


def test_skip_bad_records_reports_how_many(tmp_path):
    data = tmp_path / "prompts.jsonl"
    good = [json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) for a in range(5)]
    data.write_text("\n".join(good[:2] + ["{broken", json.dumps({"prompt": "3+3="})] + good[2:]) + "\n")
    code, console = run_capturing(config_for(tmp_path / "run", prompt_data=str(data), skip_bad_records="true"))
    assert code == 0
    assert "--skip-bad-records skipped 2 malformed record(s)" in console
    assert all(r["data/skipped_records"] == 2 for r in records(tmp_path / "run") if r["step"] > 0)
