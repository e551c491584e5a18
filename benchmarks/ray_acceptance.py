"""Issue 18's GPU acceptance in one command: what Ray adds to the RL step of the 50M quickstart on one GPU.

    python3 benchmarks/ray_acceptance.py OUTDIR [--engines embedded,embedded-process,sglang,disaggregated]
                                                [--num-rollout 30] [--repeats 3] [--cpus 0-7]
                                                [--rollout-manager actor|rank]

For each engine (colocated on the one GPU: the in-process embedded engine, the embedded engine in its own process,
SGLang when it is installed; and with two GPUs visible ``disaggregated``: the trainer on GPU 0, an embedded engine
process on GPU 1, its own bundle under Ray) it runs ``redline train examples/quickstart_gpu_50m.toml`` twice,
without Ray and with ``--ray-address local`` (the trainer rank a Ray actor on a one-GPU bundle; engine fault
tolerance on, as it is by default under Ray: it watches a colocated engine process), in alternating order so that
neither always runs on a warmer machine. The engine process also runs under Ray without fault tolerance
(``ray-no-ft``) and without Ray with it (``no-ray-ft``), which tells what each adds. It writes
OUTDIR/<engine>-<placement>/ (metrics.jsonl, report.md, placement.json under Ray), OUTDIR/<engine>-<placement>.log,
and OUTDIR/summary.md + summary.json: per run the median ``perf/step_time`` and phase times (a table of them in
summary.md) over the steps after the first two (step 1 pays first-call costs), the final eval reward, the whole
command's wall time (Ray's start-up included), and Ray's overhead on the median step, (ray - no-ray) / no-ray; the
issue's target is at most 2 %. ``--repeats N`` runs every pair N times, alternating the order each time, and
reports per run the median over its repeats (each repeat's median step listed beside it): the same code's step
differs by several per cent between single runs, more than the 2 % the target resolves. So the verdict is given
only when each placement's repeats agree within the target, or when every pairing of runs falls on the same side of
it (``verdict``); otherwise the overhead is reported as not resolved, with the repeats' spread (``summary.json``:
``repeat_spread``). The 50M step is bound by the host, and host speed is what varies between runs: ``--cpus``
(taskset's list syntax) pins every run, Ray's runtime and workers included, to the same cores (a local Ray runtime
sizes itself, and so its ranks' torch threads, to them). ``--rollout-manager`` is passed to the runs under Ray:
where each rank's rollout manager runs (default: the actor).

``--config`` takes another TOML; the CPU test (``tests/loop/test_ray_acceptance.py``) runs ``examples/quickstart.toml
--engines embedded --num-rollout 4 --repeats 2`` (steps 3 and 4 measured).
Ray must be installed on the machine (``python3 ../shared/device/stage.py ray`` stages it for the offline GPU box).
"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"embedded": ["--rollout-engine", "embedded", "--no-embedded-engine-process"],
           "embedded-process": ["--rollout-engine", "embedded", "--embedded-engine-process"],
           "sglang": ["--rollout-engine", "sglang"],
           # the trainer on one GPU, an embedded engine process on a second (a bundle of its own under Ray)
           "disaggregated": ["--rollout-engine", "embedded", "--no-colocate", "--rollout-num-gpus", "1"]}
PLACEMENTS = {"no-ray": [], "ray": ["--ray-address", "local"]}
# an engine process is watched by fault tolerance under Ray by default: these two runs tell its cost from Ray's
FAULT_TOLERANCE_RUNS = {"ray-no-ft": ["--ray-address", "local", "--no-use-fault-tolerance"],
                        "no-ray-ft": ["--use-fault-tolerance"]}
WATCHED_ENGINES = ("embedded-process",)
PHASES = ("perf/step_time", "perf/rollout_time", "perf/logprob_time", "perf/train_time", "perf/update_weights_time",
          "perf/idle_time")
SKIPPED_STEPS = 2
TARGET = 0.02
RUN_TIMEOUT_S = 1200


def cpu_set(text: str) -> set[int]:
    """The CPUs of a taskset-style list (``0-7``, ``0,2,4-6``); ValueError naming ``--cpus`` when it is malformed or
    names a CPU this process may not run on."""
    cpus: set[int] = set()
    try:
        for item in text.split(","):
            first, _, last = item.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"--cpus {text!r}: expected a list like 0-7 or 0,2,4-6") from None
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"--cpus {text!r}: CPUs {sorted(cpus - allowed) or '(none)'} are not among this process's "
                         f"{len(allowed)} usable CPUs ({min(allowed)}-{max(allowed)})")
    return cpus


def pinned(cpus: set[int] | None):
    """A subprocess ``preexec_fn`` confining the child (and everything it starts) to ``cpus``; None when unpinned."""
    return None if cpus is None else lambda: os.sched_setaffinity(0, cpus)


def run(out: Path, name: str, config: str, flags: list[str], cpus: set[int] | None = None) -> dict:
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)  # a run that fails before --overwrite acts must not report an older one
    cmd = [sys.executable, "-m", "redline.cli", "train", config, "--output-dir", str(folder), "--overwrite", *flags]
    with open(out / f"{name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        began = time.perf_counter()
        code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                              preexec_fn=pinned(cpus), check=False).returncode
    metrics = folder / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in records if r["step"] > SKIPPED_STEPS and "perf/step_time" in r]
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    wall_s = time.perf_counter() - began
    return {"exit_code": code, "wall_s": wall_s, "steps": len([r for r in records if r["step"] > 0]),
            "eval_reward_first": evals[0] if evals else None, "eval_reward_last": evals[-1] if evals else None,
            "engine_restarts": sum(r.get("rollout/engine_restarts", 0) for r in records),
            **{f"median {k}": statistics.median(r[k] for r in steps) if steps else None for k in PHASES}}


def over_repeats(repeats: list[dict]) -> dict:
    """One run's result over its repeats: medians of the repeats' medians, every repeat's exit code and step."""
    merged = {**repeats[0], "exit_code": max((r["exit_code"] for r in repeats), key=abs),
              "repeat_steps": [r["median perf/step_time"] for r in repeats]}
    for key in [k for k in repeats[0] if k.startswith("median ")]:
        values = [r[key] for r in repeats if r[key] is not None]
        merged[key] = statistics.median(values) if values else None
    merged["wall_s"] = statistics.median(r["wall_s"] for r in repeats)
    return merged


def seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def spread(steps: list[float]) -> float:
    """How far one placement's repeats disagree: (max - min) / median of their median steps."""
    return (max(steps) - min(steps)) / statistics.median(steps)


def verdict(overhead: float | None, base_steps: list[float], ray_steps: list[float]) -> tuple[str, float | None]:
    """``(text, noise)`` for one engine: the overhead against the 2 % target. Decided when the repeats of each
    placement agree within the target (``noise``, the larger ``spread``; None with fewer than two measured runs
    of a placement, where the run-to-run noise is unknown), or, when they do not, when every pairing of a run
    without Ray with a run under Ray falls on the same side of the target: every Ray run more than 2 % slower than
    the slowest run without Ray misses it whatever the noise, and every Ray run within 2 % of the fastest one meets
    it. Otherwise the overhead is reported as not resolved."""
    if overhead is None:
        return "–", None
    if len(base_steps) < 2 or len(ray_steps) < 2:
        return f"{overhead:+.1%} (fewer than two measured runs of a placement: the run-to-run noise is unknown; " \
               "--repeats 3)", None
    noise = max(spread(base_steps), spread(ray_steps))
    if noise <= TARGET:
        return f"{overhead:+.1%} ({'meets' if overhead <= TARGET else 'misses'} ≤ 2 %; repeats within {noise:.1%})", \
            noise
    least, most = min(ray_steps) / max(base_steps) - 1, max(ray_steps) / min(base_steps) - 1
    if least > TARGET:
        return f"{overhead:+.1%} (misses ≤ 2 %: every Ray run is at least {least:+.1%} slower than every run without " \
               f"Ray; repeats differ by {noise:.0%})", noise
    if most <= TARGET:
        return f"{overhead:+.1%} (meets ≤ 2 %: no Ray run is more than {most:+.1%} slower than any run without Ray; " \
               f"repeats differ by {noise:.0%})", noise
    return f"{overhead:+.1%} (not resolved: one placement's repeats differ by {noise:.0%}, and pairs of runs give " \
           f"{least:+.0%} to {most:+.0%})", noise


def phase_table(results: dict) -> str:
    """Where the time goes: every run's median phase times (ms) and its step against its engine's run without Ray;
    ``ray-no-ft`` is Ray without engine fault tolerance, ``no-ray-ft`` fault tolerance without Ray."""
    rows = ["| run | " + " | ".join(f"{k.removeprefix('perf/')} (ms)" for k in PHASES) + " | step vs no-ray |",
            "| --- |" + " ---: |" * (len(PHASES) + 1)]
    for name, result in results.items():
        ref = results[f"{result['engine']}-no-ray"]["median perf/step_time"]
        step = result["median perf/step_time"]
        times = ["–" if result[f"median {k}"] is None else f"{result[f'median {k}'] * 1e3:.2f}" for k in PHASES]
        rows.append(f"| {name} | {' | '.join(times)} | {f'{(step - ref) / ref:+.1%}' if step and ref else '–'} |")
    return "\n".join(rows)


def placements_of(engine: str) -> dict[str, list[str]]:
    """The runs of ``engine``: without and under Ray, and for engines under fault tolerance the two mixed."""
    return {**PLACEMENTS, **(FAULT_TOLERANCE_RUNS if engine in WATCHED_ENGINES else {})}


def run_order(engines: list[str], placements, repeats: int) -> list[tuple[int, str, str]]:
    """``(repeat, engine, placement)`` in the order they run (``placements(engine)``: its runs' names, in order).
    Each engine's runs go in reverse order every other repeat, and neighbouring engines start from opposite ends, so
    a drift of the host's speed during the sitting falls on both sides of every comparison."""
    order = []
    for repeat in range(repeats):
        for i, engine in enumerate(engines):
            names = list(placements(engine))
            order += [(repeat, engine, name) for name in (names if (i + repeat) % 2 == 0 else names[::-1])]
    return order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", default="examples/quickstart_gpu_50m.toml")
    parser.add_argument("--engines", default="embedded,embedded-process,sglang,disaggregated")
    parser.add_argument("--num-rollout", type=int, default=None, help="RL steps per run (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every engine and placement, alternating")
    parser.add_argument("--cpus", default=None, help="pin every run to these CPUs (taskset list: 0-7)")
    parser.add_argument("--rollout-manager", choices=("actor", "rank"), default="actor",
                        help="the runs under Ray: where each rank's rollout manager runs")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    try:
        cpus = cpu_set(args.cpus) if args.cpus else None
    except ValueError as exc:
        parser.error(str(exc))
    write_environment(args.out)  # device, versions, date, commit beside the summary
    extra = ["--num-rollout", str(args.num_rollout)] if args.num_rollout else []
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "sglang" in engines and subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True,
                                          check=False).returncode:
        print("sglang is not installed here: its runs are skipped")
        engines.remove("sglang")
    probe = "import torch; print(torch.cuda.device_count(), torch.get_num_threads())"
    gpus, threads = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                   preexec_fn=pinned(cpus), check=False).stdout.split() or ["0", "?"]
    if "disaggregated" in engines and int(gpus or 0) < 2:
        print(f"{gpus or 0} GPU(s) visible: the disaggregated runs (2 GPUs) are skipped")
        engines.remove("disaggregated")
    repeats: dict[str, list[dict]] = {}
    manager = ["--rollout-manager", args.rollout_manager]
    for repeat, engine, placement in run_order(engines, placements_of, args.repeats):
        flags = placements_of(engine)[placement]
        name = f"{engine}-{placement}"
        folder = name if repeat == 0 else f"{name}-{repeat + 1}"
        print(f"running {folder} ...", flush=True)
        result = {"engine": engine, "placement": placement,
                  **run(args.out, folder, args.config,
                        [*ENGINES[engine], *flags, *(manager if "--ray-address" in flags else []), *extra], cpus)}
        repeats.setdefault(name, []).append(result)
        print(f"  {result}", flush=True)
    results = {name: over_repeats(runs) for name, runs in repeats.items()}
    rows = [("| engine | no Ray: median step (s) | Ray: median step (s) | Ray overhead | eval reward no Ray / Ray | "
             "wall s no Ray / Ray | exit codes | repeats' steps no Ray / Ray (s) |"),
            "| --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
    # a rank's torch threads and niceness under Ray (placement.json) against a process of its own's
    ranks = {name: json.loads((args.out / name / "placement.json").read_text())[0]["attempts"][0]
             for name in results if (args.out / name / "placement.json").exists()}
    summary = {"config": args.config, "cpus": sorted(cpus) if cpus else None,
               "rollout_manager": args.rollout_manager, "runs": results, "overhead": {},
               "torch_threads_without_ray": threads, "ray_rank": ranks}
    for engine in engines:
        base, ray = results[f"{engine}-no-ray"], results[f"{engine}-ray"]
        a, b = base["median perf/step_time"], ray["median perf/step_time"]
        overhead = (b - a) / a if a and b else None
        text, noise = verdict(overhead, [v for v in base["repeat_steps"] if v is not None],
                              [v for v in ray["repeat_steps"] if v is not None])
        summary["overhead"][engine] = overhead
        summary.setdefault("repeat_spread", {})[engine] = noise
        rows.append(f"| {engine} | {seconds(a)} | {seconds(b)} | {text} | {base['eval_reward_last']} / "
                    f"{ray['eval_reward_last']} | {base['wall_s']:.0f} / {ray['wall_s']:.0f} | {base['exit_code']} / "
                    f"{ray['exit_code']} | {', '.join(seconds(v) for v in base['repeat_steps'])} / "
                    f"{', '.join(seconds(v) for v in ray['repeat_steps'])} |")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "summary.md").write_text(
        f"# Ray's overhead on the RL step ({args.config})\n\nMedians over the steps after "
        f"step {SKIPPED_STEPS}, then over {args.repeats} repeat(s) of each run. Under Ray the rollout manager runs "
        f"in {'an actor' if args.rollout_manager == 'actor' else 'each rank'} (--rollout-manager). CPUs: "
        f"{args.cpus + ' (every run pinned)' if cpus else 'all, unpinned'}. torch threads without Ray: "
        f"{threads}; under Ray (rank 0: threads, niceness): "
        + (", ".join(f"{n} {r.get('torch_threads')}, {r.get('niceness')}" for n, r in ranks.items()) or "–")
        + "\n\n" + "\n".join(rows) + "\n\n" + phase_table(results) + "\n")
    print((args.out / "summary.md").read_text())
    return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
