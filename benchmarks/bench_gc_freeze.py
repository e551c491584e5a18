"""What freezing the start-up's objects out of Python's garbage collector (``redline.long_lived``) does to the RL
step: ``redline train`` runs with ``REDLINE_GC_FREEZE=0`` (Python's collector as it comes) and with the default
(the loop's objects frozen before the first step), alternating, each in a process of its own.

    python3 benchmarks/bench_gc_freeze.py OUT [--config examples/quickstart.toml] [--num-rollout 60] [--repeats 3]
                                              [--extra "--ray-address local"]

Per run, from its ``metrics.jsonl``: the median, mean, 90th percentile and longest ``perf/step_time`` over steps 3
on, and the median rollout and train phases. From the run's own process (``gc.callbacks``; under
``--ray-address`` that is the launcher, not the rank): each full (generation 2) collection's pause, counted from
the loop's start on. Writes ``OUT/gc-freeze.json`` (every step, every pause, the environment) and
``OUT/gc-freeze.md``; the JSON names the machine (GPUs through NVML, CPU count and processor).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("collector as it comes", "frozen (default)")
CHILD = "--child"  # this script's own runs: --child PAUSES_FILE TRAIN_ARGS...
FIRST_STEP = 3  # steps 1-2 carry the first rollout's and first update's one-time costs


def child(pauses_file: Path, train_args: list[str]) -> None:
    """``redline train train_args`` in this process, writing to ``pauses_file`` ``{"loop_began": s, "loop_ended": s,
    "pauses": [[start s, seconds], ...]}`` of its full (generation 2) collections, on ``time.perf_counter``'s
    clock. The loop is the block of ``long_lived_frozen`` (whether or not it froze); None where this process ran
    no loop (under ``--ray-address`` the ranks are actors)."""
    import contextlib
    import gc

    import redline.loop.train as train

    record: dict = {"loop_began": None, "loop_ended": None, "pauses": []}
    began: list[float] = []

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began.append(time.perf_counter())
            else:
                record["pauses"].append([began[-1], time.perf_counter() - began[-1]])

    frozen = train.long_lived_frozen

    @contextlib.contextmanager
    def marked():
        with frozen():  # its own collection, once before the first step, is not the loop's
            record["loop_began"] = time.perf_counter()
            try:
                yield
            finally:
                record["loop_ended"] = time.perf_counter()

    train.long_lived_frozen = marked
    gc.callbacks.append(on_collection)
    from redline.cli import main as redline

    try:
        redline(["train", *train_args])  # click ends it with SystemExit(the run's exit code)
    finally:
        gc.callbacks.remove(on_collection)
        pauses_file.write_text(json.dumps(record))


def summary(run: Path, pauses: dict) -> dict:
    """One run's numbers (milliseconds): steps from ``FIRST_STEP`` on; full collections once the loop began (None
    where the run's own process ran no loop)."""
    from redline.loop.metrics import read_records

    steps = [r for r in read_records(run / "metrics.jsonl") if "perf/step_time" in r and r["step"] >= FIRST_STEP]
    step_ms = sorted(1e3 * r["perf/step_time"] for r in steps)
    began, ended = pauses["loop_began"], pauses["loop_ended"]
    in_loop = None if began is None else [1e3 * seconds for start, seconds in pauses["pauses"]
                                          if began <= start <= ended]
    p90 = statistics.quantiles(step_ms, n=10, method="inclusive")[-1] if len(step_ms) > 1 else step_ms[0]
    return {"steps": len(step_ms), "median_step_ms": statistics.median(step_ms),
            "mean_step_ms": statistics.mean(step_ms), "max_step_ms": step_ms[-1],
            "p90_step_ms": p90,
            "median_rollout_ms": statistics.median(1e3 * r["perf/rollout_time"] for r in steps),
            "median_train_ms": statistics.median(1e3 * r["perf/train_time"] for r in steps),
            "step_ms": [1e3 * r["perf/step_time"] for r in steps], "full_collection_ms_in_loop": in_loop}


def table(runs: list[dict]) -> str:
    lines = ["| run | median step (ms) | mean | p90 | longest | rollout | train | full collections in the loop: "
             "count, total ms, longest |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        s, pauses = r["summary"], r["summary"]["full_collection_ms_in_loop"]
        collections = ("not this process's" if pauses is None else
                       f"{len(pauses)}, {sum(pauses):.0f}, {max(pauses, default=0.0):.0f}")
        lines.append(f"| {r['mode']}, repeat {r['repeat']} | {s['median_step_ms']:.1f} | {s['mean_step_ms']:.1f} | "
                     f"{s['p90_step_ms']:.1f} | {s['max_step_ms']:.1f} | {s['median_rollout_ms']:.1f} | "
                     f"{s['median_train_ms']:.1f} | {collections} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD]:  # one run: redline train ends the process with the run's exit code
        child(Path(argv[1]), argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", default=str(ROOT / "examples" / "quickstart.toml"))
    ap.add_argument("--num-rollout", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the two modes")
    ap.add_argument("--extra", default="", help="more redline train flags, one string")
    args = ap.parse_args(argv)
    if args.num_rollout <= FIRST_STEP or args.repeats < 1:
        ap.error(f"--num-rollout must exceed {FIRST_STEP} and --repeats be at least 1")
    from redline.env_report import gpus, software, source_revision
    from redline.long_lived import FREEZE_ENV

    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for repeat in range(args.repeats):
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for mode in order:
            name = f"{'off' if mode == MODES[0] else 'frozen'}-{repeat}"
            run, pauses_file = args.out / name, args.out / f"{name}.pauses.json"
            env = {**os.environ, FREEZE_ENV: "0" if mode == MODES[0] else "1"}
            command = [sys.executable, __file__, CHILD, str(pauses_file), args.config, "--num-rollout",
                       str(args.num_rollout), "--output-dir", str(run), "--overwrite", *shlex.split(args.extra)]
            with open(args.out / f"{name}.log", "w") as log:
                code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
            if code != 0:
                raise SystemExit(f"{name} exited with {code}; see {args.out / (name + '.log')}")
            result = summary(run, json.loads(pauses_file.read_text()))
            runs.append({"mode": mode, "repeat": repeat, "summary": result})
            print(f"{name}: median {result['median_step_ms']:.1f} ms, mean {result['mean_step_ms']:.1f}, longest "
                  f"{result['max_step_ms']:.1f}", flush=True)
    date = time.strftime("%Y-%m-%d")
    report = {"config": args.config, "num_rollout": args.num_rollout, "extra": args.extra, "runs": runs,
              "software": software(), "gpus": gpus(), "cpus": os.cpu_count(), "processor": platform.processor(),
              "commit": source_revision(), "date": date}
    (args.out / "gc-freeze.json").write_text(json.dumps(report, indent=2))
    text = (f"# Freezing the start-up's objects out of the garbage collector ({date}, {report['commit']})\n\n"
            f"`redline train {Path(args.config).name} --num-rollout {args.num_rollout} {args.extra}`, steps "
            f"{FIRST_STEP}-{args.num_rollout}, modes alternating.\n\n{table(runs)}\n")
    (args.out / "gc-freeze.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
