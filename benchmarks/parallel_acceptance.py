"""Issue 17's GPU acceptance in one sitting, on a 2x or 4x H200 machine:

    python3 benchmarks/parallel_acceptance.py OUTDIR              # every run the visible GPUs allow
    python3 benchmarks/parallel_acceptance.py OUTDIR --only tp2-sp-sglang2   # one run; the report covers every
                                                                  # run with a result in OUTDIR (models kept)
    python3 benchmarks/parallel_acceptance.py OUTDIR --dry-run    # the plan, the commands, the configs; no run
    python3 benchmarks/parallel_acceptance.py OUTDIR --profile    # also trace each run's last step: per phase,
                                                                  # rank 0's GPU idle share and NCCL time not
                                                                  # overlapped by compute (why a scaling misses)
    python3 benchmarks/parallel_acceptance.py OUTDIR --cpu --model tiny --base-config examples/quickstart.toml \
        --dtype float32 --slice-layers 2 --steps 2 --extra "--rollout-batch-size 4 --global-batch-size 32 \
        --sft-steps 0"                                           # the smoke test on a CPU machine (gloo)

Runs ``redline train`` under torchrun (``examples/qwen3_1p7b_breakdown.toml``'s GRPO workload: addition prompts,
16 prompts x 8 samples of 128 tokens per rollout, two optimizer steps per rollout, ``--offload-rollout``), with a
random-weight model of Qwen3-8B's shape (``redline.loop.builtin``; fp32 master weights, as every redline run):

* acceptance (the whole 8B model, ``--steps`` RL steps, SGLang colocated with ``--rollout-num-gpus-per-engine``):
  ``tp2-sp-sglang2`` TP=2 + SP trainer with one TP=2 SGLang engine on 2 GPUs; with 4 GPUs also ``tp4-sp-sglang4``
  (TP=4 + SP, one TP=4 engine) and ``pp2-tp2-sp-sglang4`` (PP=2 x TP=2, one engine over the group's 4 GPUs);
  SP runs NCCL collectives around the GEMMs (``--tp-comm-overlap`` off, the loop's default; add it to ``--extra``
  for async TP);
* scaling (the same model sliced to ``--slice-layers`` layers so that TP=1 fits one GPU, same batch):
  ``slice-tp1`` on 1 GPU, ``slice-tp2-sp`` on 2, ``slice-pp2`` on 2, with 4 GPUs ``slice-tp4-sp``;
  ``scaling_efficiency = t_train(slice-tp1) / (gpus x t_train(run))`` on the median ``perf/train_time`` of the
  steps after the first (target >= 0.85, issue 17).

Per run: ``OUTDIR/<run>/`` (metrics.jsonl, report.md, phase_times.png) and ``OUTDIR/<run>.log``. Then
``OUTDIR/acceptance.json`` (every run's command, per-phase medians and step-1 times, GPU memory, scaling) and
``OUTDIR/acceptance.md`` (the same as tables). Phases: ``redline.loop.metrics.PHASES`` and their parts; memory:
``perf/gpu_mem_gb`` (NVML, the GPU's used memory, sampled through the step; max over the steps) when the run
sampled it. Correctness: the largest ``train/rollout_logprob_abs_diff`` (the engine's log-probs against the
trainer's on the same tokens) of each run: engine TP ranks loaded with wrong weights (SGLang has no whole-tensor
check of TP shards) would show as a gap far above the bf16 noise of the single-GPU runs. Exit status: 0 all
runs ran and the scaling targets hold, 1 a target missed, 2 a run failed (the others still run).

``--engine``: ``auto`` (SGLang when importable, else the embedded engine, which runs unsharded on every GPU
beside the TP trainer: then ``--rollout-num-gpus-per-engine`` stays 1 and the summary says the multi-GPU engine
was not measured). NCCL multicast is off (``NCCL_NVLS_ENABLE=0`` and friends), as on the lent machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from redline.env_report import source_revision, write_environment

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "examples" / "qwen3_1p7b_breakdown.toml"
MODEL = "qwen3-8b"
SCALING_TARGET = 0.85
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                 "UB_SKIPMC": "1"}


@dataclass
class Run:
    """One ``redline train`` launch: ``gpus`` processes (one GPU each), the trainer's TP/PP/SP, the engine and its
    GPUs per engine, on the ``full`` model or its ``slice``; ``role``: acceptance or scaling."""

    name: str
    gpus: int
    tp: int = 1
    pp: int = 1
    sp: bool = False
    engine: str = "sglang"
    gpus_per_engine: int = 1
    model: str = "full"
    role: str = "acceptance"
    overrides: dict = field(default_factory=dict)  # config fields -> values, beyond the parallel layout

    def flags(self) -> dict:
        """Config field -> value for this run (``redline.config`` names; flags are ``--`` + dashes)."""
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                "sequence_parallel": self.sp, "rollout_engine": self.engine,
                "rollout_num_gpus_per_engine": self.gpus_per_engine, **self.overrides}


def plan_runs(gpus: int, engine: str, *, scaling: bool = True) -> list[Run]:
    """The runs ``gpus`` GPUs allow (2 or more). ``engine``: sglang (one engine per model-parallel group, over its
    TP x PP GPUs, as redline requires) or embedded (one unsharded engine per model-parallel group)."""
    if gpus < 2:
        raise ValueError(f"issue 17's acceptance needs 2 or 4 GPUs, {gpus} visible")

    def per_engine(tp, pp=1):
        return tp * pp if engine == "sglang" else 1

    sglang = "sglang" if engine == "sglang" else "embedded"
    runs = [Run(f"tp2-sp-{sglang}{per_engine(2)}", 2, tp=2, sp=True, engine=engine, gpus_per_engine=per_engine(2))]
    if gpus >= 4:
        runs += [Run(f"tp4-sp-{sglang}{per_engine(4)}", 4, tp=4, sp=True, engine=engine,
                     gpus_per_engine=per_engine(4)),
                 Run(f"pp2-tp2-sp-{sglang}{per_engine(2, 2)}", 4, tp=2, pp=2, sp=True, engine=engine,
                     gpus_per_engine=per_engine(2, 2))]
    if scaling:
        layouts = [("slice-tp1", 1, 1, 1, False), ("slice-tp2-sp", 2, 2, 1, True), ("slice-pp2", 2, 1, 2, False)]
        if gpus >= 4:
            layouts.append(("slice-tp4-sp", 4, 4, 1, True))
        # the same engine layout as the acceptance runs; only perf/train_time is compared
        runs += [Run(name, n, tp=tp, pp=pp, sp=sp, engine=engine, gpus_per_engine=per_engine(tp, pp),
                     model="slice", role="scaling") for name, n, tp, pp, sp in layouts]
    return runs


def cli_flags(values: dict) -> list[str]:
    """``redline train`` flags for config fields: ``--x V``, booleans ``--x`` / ``--no-x``."""
    flags = []
    for key, value in values.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [name, str(value)]
    return flags


def command(run: Run, *, model_dir: Path, out: Path, steps: int, python: str, extra: list[str],
            base_config: Path = BASE_CONFIG, dtype: str = "bfloat16", profile: bool = False) -> list[str]:
    """The launch of ``run``: torchrun with one process per GPU, the base config, the run's flags; ``profile``:
    its last step traced (``--use-pytorch-profiler``)."""
    launcher = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.gpus}"]
    flags = {"hf_checkpoint": str(model_dir), "num_rollout": steps, "output_dir": str(out / run.name),
             "backend": "bf16", "dtype": dtype, "overwrite": True, **run.flags()}
    if profile:
        flags.update(use_pytorch_profiler=True, profile_step_start=steps, profile_step_end=steps + 1)
    return [*launcher, "-m", "redline.cli", "train", str(base_config), *cli_flags(flags), *extra]


def check_command(argv: list[str]) -> dict:
    """Parse a launch's ``redline train`` arguments with the real CLI (nothing runs) and apply them to the base
    config; returns the resulting config as ``{section: {key: value}}``. Raises on an unknown flag or value."""
    import click

    from redline.cli import main
    from redline.config import RunConfig
    from redline.configfile import apply_overrides, load_toml, to_mapping

    args = argv[argv.index("train") + 1:]
    with click.Context(main) as parent:
        train = main.get_command(parent, "train")
        ctx = train.make_context("train", list(args), parent=parent)
    flags = {k: v for k, v in ctx.params.items() if v is not None and k not in ("config_path", "debug")}
    return to_mapping(apply_overrides(load_toml(RunConfig, ctx.params["config_path"]), flags))


def check_engine_layout(run: Run, config: dict) -> None:
    """The run's engine layout passes redline's start-up check (``--rollout-num-gpus-per-engine`` against its
    processes), as the launch will run it."""
    from redline.config import RunConfig
    from redline.configfile import from_mapping
    from redline.loop.engine_placement import check_engine_gpus

    check_engine_gpus(from_mapping(RunConfig, config), engine=run.engine, world_size=run.gpus,
                      local_world_size=run.gpus)


# ---------------------------------------------------------------- results


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def phase_keys() -> list[str]:
    from redline.loop.metrics import PHASE_PARTS, PHASES

    return ["perf/step_time", *PHASES, *(p for parts in PHASE_PARTS.values() for p in parts)]


def summarize_run(records: list[dict]) -> dict:
    """Median of each phase over the steps after the first (warm-up) and not traced by the profiler, step 1
    apart, and the GPU memory."""
    if not records:
        return {"steps": 0}
    later = [r for r in records[1:] if not r.get("perf/profiled")] or records  # traced steps run slower
    phases = {}
    for key in phase_keys():
        values = [r[key] for r in later if key in r]
        if values:
            phases[key] = {"median_s": statistics.median(values), "step1_s": records[0].get(key)}
    memory = [r["perf/gpu_mem_gb"] for r in records if "perf/gpu_mem_gb" in r]
    # the engine's log-probs against the trainer's: a wrong weight on any engine TP rank shows here first
    gaps = [r["train/rollout_logprob_abs_diff"] for r in records if "train/rollout_logprob_abs_diff" in r]
    return {"steps": len(records), "phases": phases, "gpu_mem_gb_max": max(memory) if memory else None,
            "logprob_gap_max": max(gaps) if gaps else None,
            "reward_mean_last": records[-1].get("rollout/reward_mean")}


PROFILED_PHASES = ("logprob", "train", "update_weights")


def profiled_phases(run_dir: Path) -> dict:
    """Rank 0's ``--use-pytorch-profiler`` summary (``redline.loop.profiling``) of ``PROFILED_PHASES``, on its own
    GPU: ``{phase: {"wall_s", "busy_s", "idle_share", "nccl_s", "exposed_nccl_s", "copy_s", "kernels"}}``;
    empty when the run was not profiled."""
    path = run_dir / "profile" / "rank0" / "summary.json"
    if not path.exists():
        return {}
    phases = json.loads(path.read_text())["phases"]
    out = {}
    for phase in PROFILED_PHASES:
        if phase in phases and phases[phase]["gpus"]:
            busiest = max(phases[phase]["gpus"].values(), key=lambda g: g["busy_s"])
            out[phase] = {"wall_s": phases[phase]["wall_s"], **busiest}
    return out


def scaling(results: dict[str, dict], runs: list[Run]) -> dict[str, dict]:
    """``t_train(slice-tp1) / (gpus x t_train(run))`` for every scaling run with a train time."""
    def train_time(name):
        phase = results.get(name, {}).get("summary", {}).get("phases", {}).get("perf/train_time")
        return phase["median_s"] if phase else None

    base = train_time("slice-tp1")
    out = {}
    for run in runs:
        if run.role != "scaling" or run.name == "slice-tp1":
            continue
        t = train_time(run.name)
        eff = base / (run.gpus * t) if base and t else None
        out[run.name] = {"gpus": run.gpus, "train_time_s": t, "baseline_train_time_s": base,
                         "scaling_efficiency": eff, "meets_target": None if eff is None else eff >= SCALING_TARGET}
    return out


def markdown(report: dict) -> str:
    lines = [f"# Issue 17 GPU acceptance ({report['device']}, {report['gpus']} GPUs)", "",
             (f"Model: {report['model']} shape, random weights, fp32 master weights; engine: {report['engine']}. "
              f"Medians over steps 2..N (step 1 in brackets). Commit: {report['commit']}."), ""]
    if report["engine"] != "sglang":
        lines += [("**SGLang was not importable: the multi-GPU SGLang engine (--rollout-num-gpus-per-engine > 1) "
                   "was NOT measured; every GPU ran the embedded engine unsharded.**"), ""]
    keys = ["perf/step_time", "perf/rollout_time", "perf/logprob_time", "perf/train_time",
            "perf/update_weights_time", "perf/sync_time", "perf/offload_rollout_time"]
    lines += ["| run | gpus | TP | PP | SP | engine GPUs | status | " + " | ".join(k.removeprefix("perf/")
                                                                             for k in keys)
              + " | GPU mem max (GB) | max engine-trainer logp gap |",
              "|" + "---|" * (9 + len(keys))]
    for name, result in report["runs"].items():
        run, summary = result["run"], result.get("summary", {})
        cells = []
        for key in keys:
            phase = summary.get("phases", {}).get(key)
            if phase is None:
                cells.append("—")
            elif phase["step1_s"] is None:
                cells.append(f"{phase['median_s']:.3f}")
            else:
                cells.append(f"{phase['median_s']:.3f} ({phase['step1_s']:.3f})")
        memory = summary.get("gpu_mem_gb_max")
        cells.append(f"{memory:.1f}" if memory is not None else "—")
        gap = summary.get("logprob_gap_max")
        cells.append(f"{gap:.4f}" if gap is not None else "—")
        lines.append(f"| {name} | {run['gpus']} | {run['tp']} | {run['pp']} | {'yes' if run['sp'] else 'no'} | "
                     f"{run['gpus_per_engine']} | {result['status']} | " + " | ".join(cells) + " |")
    if report.get("missing"):
        lines += ["", f"Not run yet (in this folder): {', '.join(report['missing'])}."]
    profiled = {name: r["profile"] for name, r in report["runs"].items() if r.get("profile")}
    if profiled:
        lines += ["", "Profiled last step, rank 0's GPU (`profile/rank0/summary.md` in each run; the medians above "
                  "leave that step out):", "",
                  "| run | phase | wall s | GPU busy s | idle | NCCL s | NCCL not overlapped s | copies s | kernels |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, phases in profiled.items():
            for phase, g in phases.items():
                lines.append(f"| {name} | {phase} | {g['wall_s']:.3f} | {g['busy_s']:.3f} | {g['idle_share']:.1%} | "
                             f"{g['nccl_s']:.3f} | {g['exposed_nccl_s']:.3f} | {g['copy_s']:.3f} | "
                             f"{g['kernels']:.0f} |")
    if report["scaling"]:
        lines += ["", f"Train-phase scaling against slice-tp1 (target >= {SCALING_TARGET:.0%}):", "",
                  "| run | gpus | train s | TP=1 train s | efficiency | target |", "|---|---|---|---|---|---|"]
        for name, s in report["scaling"].items():
            eff = f"{s['scaling_efficiency']:.1%}" if s["scaling_efficiency"] is not None else "—"
            met = {True: "met", False: "MISSED", None: "—"}[s["meets_target"]]
            t = f"{s['train_time_s']:.3f}" if s["train_time_s"] else "—"
            b = f"{s['baseline_train_time_s']:.3f}" if s["baseline_train_time_s"] else "—"
            lines.append(f"| {name} | {s['gpus']} | {t} | {b} | {eff} | {met} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- driver


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_engine(choice: str) -> str:
    if choice != "auto":
        return choice
    from redline.extras import available

    return "sglang" if available("sglang") else "embedded"


def model_dirs(out: Path, model: str, slice_layers: int) -> dict[str, Path]:
    return {"full": out / "models" / model, "slice": out / "models" / f"{model}-{slice_layers}-layers"}


def make_models(dirs: dict[str, Path], model: str, slice_layers: int, needed: set[str], dtype: str) -> None:
    """The random-weight HF folders the runs need (in the runs' dtype, drawn on the GPU when there is one), made
    once under ``OUT/models``."""
    import torch

    from redline.loop.builtin import builtin_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for kind in sorted(needed):
        if not (dirs[kind] / "config.json").exists():
            builtin_model(dirs[kind], model, dtype=getattr(torch, dtype), device=device,
                          num_hidden_layers=slice_layers if kind == "slice" else None,
                          vocab_multiple=4)  # a character vocabulary that TP=2 and TP=4 split (tiny)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Issue 17's GPU acceptance (TP/SP/PP trainer, multi-GPU SGLang "
                                                 "engines) in one sitting")
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; 2 or 4)")
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run (default 10)")
    parser.add_argument("--slice-layers", type=int, default=8,
                        help="layers of the scaling runs' model slice (TP=1 must fit one GPU; default 8)")
    parser.add_argument("--engine", choices=["auto", "sglang", "embedded"], default="auto")
    parser.add_argument("--model", default=MODEL, help=f"built-in model shape (default {MODEL}; tiny for the "
                                                        "CPU smoke test)")
    parser.add_argument("--base-config", type=Path, default=BASE_CONFIG,
                        help="the workload's TOML (default examples/qwen3_1p7b_breakdown.toml)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--cpu", action="store_true",
                        help="run on the CPU (gloo, embedded engine): the smoke test of this script at a tiny size")
    parser.add_argument("--only", default=None, help="comma-separated run names to run (default: all planned)")
    parser.add_argument("--no-scaling", action="store_true", help="skip the scaling runs")
    parser.add_argument("--profile", action="store_true",
                        help="trace each run's last step (--use-pytorch-profiler): per phase, rank 0's GPU idle share "
                             "and NCCL time not overlapped by compute, in the report")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run (default 1800)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the runs")
    parser.add_argument("--extra", default="", help="more `redline train` flags for every run (one string)")
    parser.add_argument("--dry-run", action="store_true",
                        help="plan, check every launch's flags with the real CLI, write plan.json; run nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing; rebuild acceptance.json/.md from the runs' results already in OUT")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is the warm-up the medians leave out)")
    if args.profile and args.steps < 3:
        parser.error("--profile needs --steps >= 3 (step 1 is the warm-up, the last step is traced)")
    if args.slice_layers < 1:
        parser.error("--slice-layers must be >= 1")
    if args.gpus is not None and args.gpus not in (2, 4):
        parser.error(f"--gpus must be 2 or 4, got {args.gpus}")
    return args


def run_one(run: Run, argv: list[str], out: Path, env: dict, timeout: float) -> dict:
    """Launch ``run``, wait (at most ``timeout`` seconds), summarise its metrics; the result is also written to
    ``OUT/<run>.result.json`` so a later invocation (``--only``, ``--report-only``) reports it too."""
    start = time.perf_counter()
    log = out / f"{run.name}.log"
    with log.open("w") as f:
        try:
            code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"run": asdict(run), "command": argv, "status": "ok" if code == 0 else f"failed ({code}; see {log.name})",
              "wall_s": time.perf_counter() - start,
              "summary": summarize_run(read_metrics(out / run.name / "metrics.jsonl")),
              "profile": profiled_phases(out / run.name)}
    (out / f"{run.name}.result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    engine = "embedded" if args.cpu else resolve_engine(args.engine)
    gpus = args.gpus or (4 if visible_gpus() >= 4 else 2 if args.dry_run or args.cpu or args.report_only
                         or visible_gpus() >= 2 else visible_gpus())
    if not (args.dry_run or args.cpu or args.report_only) and visible_gpus() < gpus:
        raise SystemExit(f"{gpus} GPUs needed, {visible_gpus()} visible (--dry-run plans without GPUs)")
    planned = plan_runs(gpus, engine, scaling=not args.no_scaling)
    runs = planned
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r.name for r in planned}
        if unknown:
            raise SystemExit(f"--only {sorted(unknown)}: not planned here; planned: {[r.name for r in planned]}")
        runs = [r for r in planned if r.name in wanted]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_environment(out)  # device, versions, date, commit beside the report
    models = model_dirs(out, args.model, args.slice_layers)
    extra = args.extra.split()
    commands = {r.name: command(r, model_dir=models[r.model], out=out, steps=args.steps, python=args.python,
                                extra=extra, base_config=args.base_config.resolve(), dtype=args.dtype,
                                profile=args.profile)
                for r in runs}
    for run in runs:  # every launch's flags parse and its engine layout passes, before anything long starts
        check_engine_layout(run, check_command(commands[run.name]))
    plan = {"gpus": gpus, "engine": engine, "model": args.model, "steps": args.steps,
            "slice_layers": args.slice_layers, "runs": [{**asdict(r), "command": commands[r.name]} for r in runs]}
    if args.dry_run:
        (out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        for run in runs:
            print(f"{run.name}: {' '.join(commands[run.name])}")
        return 0

    if not args.report_only:
        make_models(models, args.model, args.slice_layers, {r.model for r in runs}, args.dtype)
        env = {**os.environ, **MULTICAST_OFF, "COLUMNS": "200"}
        for run in runs:
            result = run_one(run, commands[run.name], out, env, args.run_timeout)
            print(f"{run.name}: {result['status']} in {result['wall_s']:.0f} s", flush=True)
    # every planned run that has a result here, from this invocation or an earlier one
    results = {r.name: json.loads((out / f"{r.name}.result.json").read_text()) for r in planned
               if (out / f"{r.name}.result.json").exists()}
    import torch

    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "gpus": gpus,
              "engine": engine, "commit": source_revision() or "unknown", "model": args.model, "steps": args.steps,
              "slice_layers": args.slice_layers, "runs": results, "scaling": scaling(results, planned),
              "missing": [r.name for r in planned if r.name not in results]}
    (out / "acceptance.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "acceptance.md").write_text(markdown(report))
    print(markdown(report))
    if any(r["status"] != "ok" for r in results.values()):
        return 2
    return 1 if any(s["meets_target"] is False for s in report["scaling"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
