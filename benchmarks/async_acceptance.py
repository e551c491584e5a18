"""Issue 19's GPU acceptance in one sitting: synchronous vs ``--async-rollout one-step`` vs ``full``.

    python3 benchmarks/async_acceptance.py OUTDIR                  # on one GPU (an H100): 6 runs
    python3 benchmarks/async_acceptance.py OUTDIR --dry-run        # the commands only
    python3 benchmarks/async_acceptance.py OUTDIR --cpu --steps 6  # the smoke test on a CPU machine
    python3 benchmarks/async_acceptance.py OUTDIR --shapes 1p7b    # one workload; later invocations into the
                                                                   # same OUTDIR add their runs to the report

Two workloads, each run three times (``sync``, ``one-step``, ``full --max-staleness 1``) for ``--steps`` RL steps:

* ``50m``: ``examples/quickstart_gpu_50m.toml`` (the ~50M quickstart: addition, GRPO, 25 prompts x 8 samples of
  at most 3 tokens; it learns, so the eval reward says what the staleness costs);
* ``1p7b``: ``examples/qwen3_1p7b_breakdown.toml`` (Qwen3-1.7B's shape with random weights, 16 prompts x 8
  samples of 128 tokens, two optimizer steps per rollout), with the bf16 backend (TE is not needed) and one
  model folder made once under ``OUTDIR/models``.

Placement (``--placement``): ``one-gpu`` (the default on a machine with one GPU): the trainer and the embedded
engine share the GPU as two processes (``--embedded-engine-process``: weights by CUDA IPC, the engine keeps its
memory: no ``--offload-rollout``), the async modes generating in the engine's process while the trainer trains
in its own; ``two-gpus`` (the default with two or more GPUs): ``--no-colocate``, the trainer on GPU 0 and the
engine process on GPU 1, weights by NCCL broadcast; ``sglang-two-gpus`` (asked for by name; needs SGLang
installed): the same with an SGLang server launched on GPU 1 (``--sglang-mem-fraction-static 0.85``, the GPU is
its own); ``cpu``: ``--no-colocate`` engine processes on the CPU. The synchronous baseline runs in the same
placement, so the three differ only by the schedule.

Per run: ``OUTDIR/<shape>-<mode>/`` (metrics.jsonl, report.md) and ``OUTDIR/<shape>-<mode>.log``. Then
``OUTDIR/async_acceptance.json`` and ``.md``: the medians over the steps after the first two (warm-up) of
``perf/step_time``, ``perf/rollout_time`` (async: the engines' generating time in the step), train
(``perf/logprob_time + perf/train_time``), ``perf/update_weights_time``, ``perf/overlap_ratio``,
``perf/train_wait_time``, ``perf/rollout_wait_time``, the largest ``rollout/staleness_max`` and the last eval
reward. The target (issue 19): one-step step time <= 1.1 x max(rollout, train) + sync, with rollout, train and
sync the synchronous run's phases of the same workload (its step time is their sum); also shown against the
one-step run's own phases. Exit status: 0 every run ran and the target holds for every workload, 1 a target
missed, 2 a run failed (the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from redline.env_report import source_revision, write_environment

REPO = Path(__file__).resolve().parent.parent
SHAPES = {"50m": REPO / "examples" / "quickstart_gpu_50m.toml",
          "1p7b": REPO / "examples" / "qwen3_1p7b_breakdown.toml"}
MODES = {"sync": [], "one-step": ["--async-rollout", "one-step"],
         "full": ["--async-rollout", "full", "--max-staleness", "1"]}
PLACEMENTS = {
    "one-gpu": ["--rollout-engine", "embedded", "--embedded-engine-process", "--no-offload-rollout"],
    "two-gpus": ["--no-colocate", "--rollout-engine", "embedded", "--rollout-num-gpus", "1",
                 "--no-offload-rollout"],
    "cpu": ["--no-colocate", "--rollout-engine", "embedded", "--no-offload-rollout"],
    "sglang-two-gpus": ["--no-colocate", "--rollout-engine", "sglang", "--rollout-num-gpus", "1",
                        "--sglang-mem-fraction-static", "0.85", "--no-offload-rollout"],
}
TARGET = 1.1
WARMUP_STEPS = 2  # CUDA graphs, allocator growth, the first pending rollout: left out of the medians


def command(shape: str, mode: str, *, out: Path, steps: int, placement: str, python: str, model_dirs: dict,
            extra: list[str]) -> list[str]:
    argv = [python, "-m", "redline.cli", "train", str(SHAPES[shape]), "--output-dir", str(out / f"{shape}-{mode}"),
            "--num-rollout", str(steps), "--overwrite", *PLACEMENTS[placement], *MODES[mode]]
    if shape == "1p7b":
        argv += ["--backend", "bf16"]
        if shape in model_dirs:
            argv += ["--hf-checkpoint", str(model_dirs[shape])]
    return argv + extra


def checked(argv: list[str]):
    """The run's config as its launch gives it, parsed by the real ``redline train`` CLI (nothing runs) and put
    through the async start-up checks; raises on an unknown flag or value or a refused combination."""
    from parallel_acceptance import check_command
    from redline.config import RunConfig
    from redline.configfile import apply_overrides
    from redline.loop.async_schedule import check_async

    flags = {key: value for section in check_command(argv).values() for key, value in section.items()}
    config = apply_overrides(RunConfig(), flags)
    check_async(config)
    return config


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict]) -> dict:
    """Medians of the timed steps (after ``WARMUP_STEPS``; all of them when there are no more), the largest
    staleness and the last eval reward."""
    steps = [r for r in records if "perf/step_time" in r]
    timed = steps[WARMUP_STEPS:] or steps
    if not timed:
        return {}
    median = lambda key: statistics.median(r.get(key, 0.0) for r in timed)
    summary = {"steps": len(steps), "step_time": median("perf/step_time"), "rollout_time": median("perf/rollout_time"),
               "train_time": statistics.median(r["perf/logprob_time"] + r["perf/train_time"] for r in timed),
               "sync_time": median("perf/update_weights_time")}
    for key in ("perf/overlap_ratio", "perf/train_wait_time", "perf/rollout_wait_time"):
        if any(key in r for r in timed):
            summary[key.removeprefix("perf/")] = median(key)
    stale = [r["rollout/staleness_max"] for r in steps if "rollout/staleness_max" in r]
    if stale:
        summary["staleness_max"] = max(stale)
    evals = [r for r in records if "eval/reward_mean" in r]
    if evals:
        summary["eval_reward"] = evals[-1]["eval/reward_mean"]
        summary["eval_step"] = evals[-1]["step"]
    return summary


def bound(phases: dict) -> float:
    """``TARGET x max(rollout, train) + sync`` of a run's phases."""
    return TARGET * max(phases["rollout_time"], phases["train_time"]) + phases["sync_time"]


def targets(results: dict) -> dict[str, dict]:
    """Per workload: the one-step step time against the bound from the synchronous run's phases (the verdict)
    and from the one-step run's own phases."""
    out = {}
    for shape in SHAPES:
        sync, one = (results.get(f"{shape}-{m}", {}).get("summary") for m in ("sync", "one-step"))
        if not sync or not one:
            continue
        out[shape] = {"one_step_time": one["step_time"], "sync_step_time": sync["step_time"],
                      "bound_from_sync_phases": bound(sync), "bound_from_own_phases": bound(one),
                      "met": one["step_time"] <= bound(sync), "speedup": sync["step_time"] / one["step_time"]}
    return out


def markdown(report: dict) -> str:
    title = (f"# Issue 19: sync vs async rollout ({report['device']}, placement {report['placement']}, "
             f"commit {report['commit']}, {report['steps']} steps, medians after step {WARMUP_STEPS})")
    columns = ["run", "status", "step s", "rollout s", "train s", "sync s", "overlap", "train wait s",
               "engine wait s", "staleness max", "eval reward"]
    lines = [title, "", "| " + " | ".join(columns) + " |", "| --- | --- |" + " ---: |" * (len(columns) - 2)]
    fmt = lambda s, key, spec=".3f": format(s[key], spec) if key in s else "–"
    for name, run in report["runs"].items():
        s = run["summary"]
        cells = [name, run["status"], fmt(s, "step_time"), fmt(s, "rollout_time"), fmt(s, "train_time"),
                 fmt(s, "sync_time"), fmt(s, "overlap_ratio", ".2f"), fmt(s, "train_wait_time"),
                 fmt(s, "rollout_wait_time"), fmt(s, "staleness_max", ".0f"), fmt(s, "eval_reward")]
        lines.append("| " + " | ".join(cells) + " |")
    target = f"Target: one-step step time <= {TARGET} x max(rollout, train) + sync (the sync run's phases)."
    columns = ["workload", "sync step s", "one-step step s", "bound (sync phases)", "bound (own phases)", "speed-up",
               "met"]
    lines += ["", target, "", "| " + " | ".join(columns) + " |", "| --- |" + " ---: |" * 5 + " --- |"]
    for shape, t in report["targets"].items():
        lines.append(f"| {shape} | {t['sync_step_time']:.3f} | {t['one_step_time']:.3f} | "
                     f"{t['bound_from_sync_phases']:.3f} | {t['bound_from_own_phases']:.3f} | {t['speedup']:.2f}x | "
                     f"{'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_model(out: Path) -> Path:
    """The 1.7B-shape model folder, made once (bf16, drawn on the GPU when there is one)."""
    import torch
    from redline.loop.builtin import builtin_model

    folder = out / "models" / "qwen3-1.7b"
    if not (folder / "config.json").exists():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        builtin_model(folder, "qwen3-1.7b", dtype=torch.bfloat16, device=device)
    return folder


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Issue 19's GPU acceptance: sync vs one-step vs fully async "
                                     "rollout on the 50M quickstart and the Qwen3-1.7B breakdown shape")
    parser.add_argument("out", type=Path, help="folder for the runs and async_acceptance.{json,md}")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run (default 20)")
    parser.add_argument("--shapes", default="50m,1p7b", help="comma-separated of: " + ", ".join(SHAPES))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated of: " + ", ".join(MODES))
    parser.add_argument("--placement", choices=["auto", *PLACEMENTS], default="auto",
                        help="auto: cpu without CUDA, two-gpus with two or more GPUs, else one-gpu")
    parser.add_argument("--cpu", action="store_true", help="the smoke test: the tiny quickstart on the CPU "
                        "(examples/quickstart.toml as the 50m workload; 1p7b is skipped)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--extra", default="", help="more flags for every run")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--python", default=sys.executable)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = args.shapes.split(",")
    modes = args.modes.split(",")
    for flag, given, known in [("--shapes", shapes, SHAPES), ("--modes", modes, MODES)]:
        if set(given) - set(known):
            raise SystemExit(f"{flag} {sorted(set(given) - set(known))}: not one of {sorted(known)}")
    if args.cpu:
        SHAPES["50m"] = REPO / "examples" / "quickstart.toml"
        shapes = [s for s in shapes if s == "50m"]
    gpus = 0 if args.cpu else visible_gpus()
    placement = args.placement
    if placement == "auto":
        placement = "cpu" if gpus == 0 else "two-gpus" if gpus >= 2 else "one-gpu"
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_environment(out)  # device, versions, date, commit beside the report
    models = {} if args.dry_run or "1p7b" not in shapes else {"1p7b": make_model(out)}
    runs = [(shape, mode) for shape in shapes for mode in modes]
    commands = {f"{s}-{m}": command(s, m, out=out, steps=args.steps, placement=placement, python=args.python,
                                    model_dirs=models, extra=args.extra.split()) for s, m in runs}
    for launch in commands.values():  # every launch parses and passes the checks before anything long starts
        checked(launch)
    if args.dry_run:
        for name, launch in commands.items():
            print(f"{name}: {' '.join(launch)}")
        return 0
    env = {**os.environ, "COLUMNS": "200", "NCCL_NVLS_ENABLE": "0"}
    saved = out / "async_acceptance.json"  # runs of earlier invocations into OUTDIR stay in the report
    results = json.loads(saved.read_text())["runs"] if saved.exists() else {}
    failed = False
    for name, launch in commands.items():
        start = time.perf_counter()
        log = out / f"{name}.log"
        with log.open("w") as f:
            try:
                code = subprocess.run(launch, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                      timeout=args.run_timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        status = "ok" if code == 0 else f"failed ({code}; see {log.name})"
        failed |= code != 0
        results[name] = {"command": launch, "status": status, "wall_s": time.perf_counter() - start,
                         "summary": summarize(read_metrics(out / name / "metrics.jsonl"))}
        print(f"{name}: {status} in {results[name]['wall_s']:.0f} s", flush=True)
    import torch

    report = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "placement": placement,
              "commit": source_revision() or "unknown", "steps": args.steps, "runs": results, "targets": targets(results)}
    (out / "async_acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "async_acceptance.md").write_text(markdown(report))
    print(markdown(report))
    if failed:
        return 2
    return 0 if report["targets"] and all(t["met"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
