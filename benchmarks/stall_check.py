"""Issue 23's GPU acceptance: no Triton compile or autotune stall inside RL steps, and a faster second start.

Runs the same ``redline train`` command twice on this machine, the first time with empty caches: Triton's
compile cache (``TRITON_CACHE_DIR``) and redline's tuning table (``REDLINE_CACHE_DIR``) both point at fresh
folders under the output folder, and the second run reuses what the first left there. From each run's
``metrics.jsonl`` it takes every step's ``perf/train_time`` and ``perf/logprob_time`` and checks that no step's
phase exceeds ``--ratio`` (1.5) times the median of steps 2–6 of that phase, and that the second run's start-up
(the kernel warm-up, ``perf/startup_compile_time``, and the wall time before its first step) is shorter.

    python benchmarks/stall_check.py OUT            # the 1.7B breakdown example, bf16, 6 rollouts, on one H100

Writes OUT/summary.json, OUT/summary.md, and each run's folder and log (OUT/run1, OUT/run1.log, ...). Exit
status 0 when every check passed, 1 otherwise. ``--config``/``--arg`` change the command (the CPU smoke test runs
the quickstart at a tiny size; there the kernels run in PyTorch, no warm-up happens and the start-up fields are
absent). ``--run 1`` then ``--run 2`` split the two runs over two commands.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from redline.env_report import write_environment

REPO = Path(__file__).resolve().parents[1]
PHASES = ("perf/train_time", "perf/logprob_time")
BASELINE_STEPS = range(2, 7)  # the "median of steps 2–6"
DEFAULT_ARGS = ["--backend", "bf16", "--num-rollout", "6"]
STALL_MARK = "the warm-up did not reach"  # in the warning a step that still compiled prints (CompileClock)


def read_steps(metrics_path: Path) -> list[dict]:
    """The step records (step ≥ 1) of a run's metrics.jsonl, in step order."""
    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r.get("step", 0) >= 1), key=lambda r: r["step"])


def phase_check(records: list[dict], key: str, ratio: float) -> dict:
    """Every step's ``key``, the median of steps 2–6 (of those present), the worst step against it, and whether
    every step stays within ``ratio`` × that median."""
    per_step = {r["step"]: r[key] for r in records if key in r}
    baseline = [v for s, v in per_step.items() if s in BASELINE_STEPS]
    if not baseline:
        return {"per_step": per_step, "median_2_6": None, "worst_step": None, "worst_ratio": None, "ok": False,
                "why": f"no {key} in steps {BASELINE_STEPS.start}–{BASELINE_STEPS.stop - 1}"}
    median = statistics.median(baseline)
    worst = max(per_step, key=per_step.get)
    worst_ratio = per_step[worst] / median if median > 0 else float("inf")
    return {"per_step": per_step, "median_2_6": median, "worst_step": worst, "worst_ratio": worst_ratio,
            "ok": worst_ratio <= ratio}


def compiled_in_steps(log_text: str) -> list[str]:
    """A run log's warnings naming each kernel a step still compiled, with its phase (``CompileClock.stall_report``)."""
    return [line.strip().removeprefix("WARNING ") for line in log_text.splitlines() if STALL_MARK in line]


def run_summary(records: list[dict], wall_s: float, ratio: float) -> dict:
    """One run: the phase checks, its start-up cost and what each step still paid in compilation."""
    first = records[0] if records else {}
    stepped = sum(r.get("perf/step_time", 0.0) for r in records)
    return {"phases": {key: phase_check(records, key, ratio) for key in PHASES},
            "startup_compile_time_s": first.get("perf/startup_compile_time"),
            "startup_compile_count": first.get("perf/startup_compile_count"),
            "startup_tuned_keys": first.get("perf/startup_tuned_keys"),
            "compile_time_per_step_s": {r["step"]: r["perf/compile_time"] for r in records
                                        if "perf/compile_time" in r},
            "wall_s": wall_s, "wall_outside_steps_s": wall_s - stepped, "steps": len(records)}


def summarize(runs: list[dict], ratio: float) -> dict:
    """Both runs and the verdicts: no stall in either, and the second one's start-up shorter."""
    first, second = runs
    no_stall = all(p["ok"] for run in runs for p in run["phases"].values())
    warm = (first["startup_compile_time_s"], second["startup_compile_time_s"])
    faster_warmup = None if None in warm else warm[1] < warm[0]
    faster_start = second["wall_outside_steps_s"] < first["wall_outside_steps_s"]
    return {"ratio": ratio, "runs": runs, "no_stall": no_stall, "second_warmup_shorter": faster_warmup,
            "second_start_shorter": faster_start, "ok": no_stall and faster_start and faster_warmup is not False}


def markdown(summary: dict, command: list[str]) -> str:
    lines = ["# Stall check (issue 23)", "", f"command: `{' '.join(command)}`", "",
             f"no step's train or log-prob phase above {summary['ratio']}× the median of steps 2–6: "
             f"**{'yes' if summary['no_stall'] else 'NO'}**; second run's warm-up shorter: "
             f"**{summary['second_warmup_shorter']}**; second run's time outside steps shorter: "
             f"**{summary['second_start_shorter']}**", ""]
    for i, run in enumerate(summary["runs"], 1):
        lines += [f"## run {i} ({'empty caches' if i == 1 else 'caches from run 1'})", "",
                  f"warm-up {_s(run['startup_compile_time_s'])} ({_n(run['startup_compile_count'])} kernels "
                  f"compiled, {_n(run['startup_tuned_keys'])} LM-head GEMM keys tuned); wall {run['wall_s']:.1f} s, "
                  f"of it outside the steps {run['wall_outside_steps_s']:.1f} s", "",
                  "| step | " + " | ".join(PHASES) + " | perf/compile_time |", "|---" * (len(PHASES) + 2) + "|"]
        steps = sorted({s for p in run["phases"].values() for s in p["per_step"]}, key=int)  # str keys from JSON
        for s in steps:
            cells = [_s(run["phases"][k]["per_step"].get(s)) for k in PHASES]
            lines.append(f"| {s} | " + " | ".join(cells) + f" | {_s(run['compile_time_per_step_s'].get(s))} |")
        for key, p in run["phases"].items():
            lines.append(f"\n{key}: median of steps 2–6 {_s(p['median_2_6'])}, worst step {p['worst_step']} at "
                         f"{_x(p['worst_ratio'])} → {'ok' if p['ok'] else 'STALL'}")
        if run.get("compiled_in_steps"):
            lines += ["", "compiled inside steps:", *(f"- {line}" for line in run["compiled_in_steps"])]
        lines.append("")
    return "\n".join(lines) + "\n"


def _s(v) -> str:
    return "–" if v is None else f"{v:.3f} s"


def _n(v) -> str:
    return "–" if v is None else str(int(v))


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output folder (caches, runs, summary)")
    parser.add_argument("--config", default=str(REPO / "examples" / "qwen3_1p7b_breakdown.toml"))
    parser.add_argument("--arg", action="append", dest="args", default=None,
                        help=f"one argument for redline train (repeat it; default: {' '.join(DEFAULT_ARGS)})")
    parser.add_argument("--ratio", type=float, default=1.5)
    parser.add_argument("--run", choices=("both", "1", "2"), default="both",
                        help="1: the first run alone (empties the caches); 2: the second alone, then the summary "
                             "(for a time limit per command)")
    opts = parser.parse_args(argv)
    out = opts.out.resolve()
    write_environment(out)  # device, versions, date, commit beside the summary
    env = dict(os.environ, TRITON_CACHE_DIR=str(out / "triton-cache"), REDLINE_CACHE_DIR=str(out / "redline-cache"))
    command = [sys.executable, "-m", "redline.cli", "train", opts.config, *(opts.args or DEFAULT_ARGS)]
    for i in (1, 2) if opts.run == "both" else (int(opts.run),):
        if i == 1:  # empty before the first run, kept for the second
            for cache in ("triton-cache", "redline-cache"):
                shutil.rmtree(out / cache, ignore_errors=True)
        folder = out / f"run{i}"
        shutil.rmtree(folder, ignore_errors=True)
        print(f"run {i}: {' '.join(command)} --output-dir {folder}", flush=True)
        began = time.perf_counter()
        with open(out / f"run{i}.log", "w") as log:
            code = subprocess.run([*command, "--output-dir", str(folder)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT, cwd=REPO).returncode
        wall = time.perf_counter() - began
        if code != 0:
            print(f"run {i} failed (exit {code}); see {out / f'run{i}.log'}", file=sys.stderr)
            return 1
        run = run_summary(read_steps(folder / "metrics.jsonl"), wall, opts.ratio)
        run["compiled_in_steps"] = compiled_in_steps((out / f"run{i}.log").read_text(errors="replace"))
        (out / f"run{i}.json").write_text(json.dumps(run, indent=1))
    if not all((out / f"run{i}.json").exists() for i in (1, 2)):
        return 0
    runs = [json.loads((out / f"run{i}.json").read_text()) for i in (1, 2)]
    summary = summarize(runs, opts.ratio)
    summary["command"] = command
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary, summary["command"]))
    print((out / "summary.md").read_text())
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
