"""End-to-end GRPO throughput: one workload, several trainers, one GPU, one sitting (issue 20).

    python benchmarks/bench_e2e.py OUT [--shapes qwen3-1.7b,qwen3-4b] [--trainers redline-embedded,trl] ...
    python benchmarks/bench_e2e.py OUT --tiny          # the redline and TRL paths on the CPU, at a tiny size
    python benchmarks/bench_e2e.py OUT --report-only   # redraw OUT's table and plot from its JSON

Workload (``e2e_workload.Workload``): a built-in Qwen3-shape model with random weights (made once into
``--model-cache``), the same prompts for every trainer, 64 prompts × 8 samples per step, fixed 1024-token
responses (EOS ignored), GRPO, bf16, lr 1e-6, 10 measured steps after 2 warm-up steps. Trainers, each in its
own process one after the other (a fresh CUDA context each; a missing package is a skip with its reason):

* ``redline-embedded``: ``redline train`` colocated with the embedded engine, ``--offload-rollout``;
* ``redline-sglang``: the same with SGLang (needs ``sglang``);
* ``trl``: TRL's ``GRPOTrainer`` with its default generation (``e2e_trl.py``; needs ``trl``);
* ``trl-vllm``: the same with vLLM colocated (``use_vllm``, ``vllm_mode="colocate"``), run by
  ``--trl-vllm-python`` (vLLM 0.26.0 lives in a venv of its own on the GPU machine: ``stage_peers.py vllm``).

Per trainer: step time, generated and trained tokens/s, per-phase seconds, peak GPU memory, train-phase MFU and
the GPU's idle share (NVML, ``redline.gpu_telemetry``). Each trainer's result lands in
``OUT/<shape>/<trainer>.json`` as soon as it finishes (a later invocation into the same OUT adds to them), and
``OUT/e2e.json``, ``OUT/e2e.md`` and ``OUT/e2e.png`` are rewritten from every result in OUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e_redline import config_toml, read_records
from e2e_workload import TINY, Workload, records_from_json, summarize, write_prompts

HERE = Path(__file__).resolve().parent
TRAINERS = ("redline-embedded", "redline-sglang", "trl", "trl-vllm")
BASELINE = "trl"  # ratios in the table are against it
HEADER = ("| trainer | steps | step s | generated tok/s | trained tok/s | vs TRL | phases (mean s) | peak GPU GB "
          "| train MFU | GPU idle |")


def environment() -> dict:
    """Versions, the GPU and the commit the results belong to (NVML only: no CUDA context in this process)."""
    from redline.env_report import gpus, software, source_revision
    from redline.extras import version

    info = {"software": software() | {name: version(name) or "missing"
                                      for name in ("trl", "accelerate", "datasets", "tokenizers")},
            "gpus": gpus(), "commit": source_revision()}
    return info


def gpu_name(env: dict) -> str | None:
    devices = env["gpus"].get("devices") or []
    return devices[0]["name"] if devices else None


def unavailable(trainer: str, has_gpu: bool, trl_vllm_python: str = sys.executable) -> str | None:
    """Why ``trainer`` cannot run here, or None. For ``trl-vllm``, ``trl_vllm_python`` (the interpreter that runs
    it) must import TRL and vLLM: a real import, which also catches a vLLM built for another torch or CUDA."""
    from redline.extras import available

    if trainer == "redline-sglang" and not (available("sglang") and has_gpu):
        return "SGLang is not installed" if not available("sglang") else "SGLang needs a CUDA GPU"
    if trainer == "trl" and not available("trl"):
        return "TRL is not installed (pip install trl)"
    if trainer == "trl-vllm":
        try:
            probe = subprocess.run([trl_vllm_python, "-c", "import trl, vllm"], capture_output=True, text=True,
                                   timeout=600)
        except subprocess.TimeoutExpired:
            return f"importing TRL and vLLM with {trl_vllm_python} took over 600 s"
        except OSError as e:
            return (f"--trl-vllm-python {trl_vllm_python} does not run ({e.strerror}); stage vLLM with "
                    "`python3 benchmarks/stage_peers.py vllm`")
        if probe.returncode:
            why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
            return (f"vLLM does not import with {trl_vllm_python} ({why}); stage it with "
                    "`python3 benchmarks/stage_peers.py vllm` and pass --trl-vllm-python")
        if not has_gpu:
            return "vLLM colocate needs a CUDA GPU"
    return None


def ensure_model(workload: Workload, cache: Path, has_gpu: bool) -> Path:
    """The built-in model folder for ``workload.shape`` (random weights, seed 0), made once in its own process."""
    folder = cache / f"{workload.shape}-{workload.dtype}"
    if (folder / "config.json").exists():
        return folder
    code = ("import sys, torch; from redline.loop.builtin import builtin_model; "
            "builtin_model(__import__('pathlib').Path(sys.argv[1]), sys.argv[2], dtype=getattr(torch, sys.argv[3]), "
            "device=sys.argv[4])")
    subprocess.run([sys.executable, "-c", code, str(folder), workload.shape, workload.dtype,
                    "cuda" if has_gpu else "cpu"], check=True)
    return folder


def count_parameters(model_dir: Path) -> int:
    """Parameters of a safetensors checkpoint, from the files' headers (nothing is loaded)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def run_process(cmd: list[str], log: Path, timeout_s: float | None, env: dict | None = None) -> str | None:
    """Run ``cmd`` with its output in ``log``; None when it succeeded, else why not. Past ``timeout_s`` it gets
    SIGTERM (redline stops its engines on it), then SIGKILL a minute later."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return f"stopped after {timeout_s:.0f} s (--trainer-timeout); see {log}"
    return None if code == 0 else f"exit code {code}; see {log}"


def run_redline(trainer: str, workload: Workload, model_dir: Path, prompts: Path, folder: Path, args) -> dict:
    engine = trainer.removeprefix("redline-")
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.toml"
    config.write_text(config_toml(workload, model_dir=model_dir, prompts=prompts, engine=engine,
                                  max_tokens_per_gpu=args.redline_max_tokens_per_gpu,
                                  sglang_mem_fraction=args.sglang_mem_fraction, offload_rollout=True))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    extra = shlex.split(args.redline_args)
    error = run_process([sys.executable, "-m", "redline.cli", "train", str(config), "--output-dir",
                         str(folder / "run"), *extra], folder / "log.txt", args.trainer_timeout, env)
    metrics = folder / "run" / "metrics.jsonl"
    records = read_records(metrics, workload) if metrics.exists() else []
    return {"records": [dataclasses.asdict(r) for r in records], "error": error,
            "num_parameters": count_parameters(model_dir),
            "settings": {"config": config.read_text(), "engine": engine, "colocated": True,
                         "offload_rollout": True, "layer_backend": "bf16", "extra_flags": extra}}


def trl_spec(trainer: str, workload: Workload, model_dir: Path, prompts: Path, result: Path, args) -> dict:
    """What ``e2e_trl.py`` runs for ``trainer`` (``trl`` or ``trl-vllm``)."""
    spec = {"workload": dataclasses.asdict(workload), "model_dir": str(model_dir), "prompts": str(prompts),
            "out": str(result), "per_device_train_batch_size": args.trl_micro_batch,
            "generation_batch_size": args.trl_generation_batch_size}
    if trainer == "trl-vllm":
        spec["vllm"] = {"gpu_memory_utilization": args.trl_vllm_gpu_memory_utilization}
    return spec


def run_trl(trainer: str, workload: Workload, model_dir: Path, prompts: Path, folder: Path, args) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "spec.json"
    result = folder / "trl.json"
    spec.write_text(json.dumps(trl_spec(trainer, workload, model_dir, prompts, result, args)))
    python = args.trl_vllm_python if trainer == "trl-vllm" else sys.executable
    error = run_process([python, str(HERE / "e2e_trl.py"), str(spec)], folder / "log.txt",
                        args.trainer_timeout, dict(os.environ, PYTHONUNBUFFERED="1"))
    if not result.exists():
        return {"records": [], "error": error or f"no result written; see {folder / 'log.txt'}"}
    return json.loads(result.read_text()) | {"error": error}


def measure(trainer: str, workload: Workload, model_dir: Path, prompts: Path, out: Path, args, env: dict) -> dict:
    """Run one trainer and summarise it; the result (also written to ``OUT/<shape>/<trainer>.json``)."""
    started = time.time()
    folder = out / workload.shape / trainer
    if trainer in ("trl", "trl-vllm"):
        raw = run_trl(trainer, workload, model_dir, prompts, folder, args)
    else:
        raw = run_redline(trainer, workload, model_dir, prompts, folder, args)
    result = {"trainer": trainer, "shape": workload.shape, "workload": dataclasses.asdict(workload),
              "wall_s": time.time() - started, "environment": env, **raw}  # versions may change between sittings
    records = records_from_json(raw["records"])
    if len(records) > workload.warmup:
        result["summary"] = summarize(records, workload, raw["num_parameters"], gpu_name(env))
    elif not raw.get("error"):
        result["error"] = f"{len(records)} steps recorded, none past the {workload.warmup} warm-up steps"
    (out / workload.shape / f"{trainer}.json").write_text(json.dumps(result, indent=2))
    return result


def load_results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/*.json"))
            if json.loads(p.read_text()).get("trainer")]


def markdown(results: list[dict], env: dict) -> str:
    lines = ["# End-to-end GRPO benchmark", ""]
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = [r for r in results if r["shape"] == shape]
        workload = Workload(**rows[0]["workload"])
        base = next((r["summary"] for r in rows if r["trainer"] == BASELINE and "summary" in r), None)
        lines += [f"## {workload.describe()}", "", HEADER,
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in rows:
            s = r.get("summary")
            if s is None:
                why = r.get("skipped") or r.get("error")
                lines.append(f"| {r['trainer']} | — | — | — | — | — | {why} | | | |")
                continue
            ratio = f"{s['trained_tokens_per_s'] / base['trained_tokens_per_s']:.2f}x" if base else "—"
            phases = ", ".join(f"{k} {v:.2f}" for k, v in s["phases_s"].items())
            lines.append(f"| {r['trainer']} | {s['steps']} after {r['workload']['warmup']} | {s['step_time_s']:.2f} | "
                         f"{s['generated_tokens_per_s']:,.0f} | {s['trained_tokens_per_s']:,.0f} | {ratio} | "
                         f"{phases} | "
                         f"{_num(s['peak_gpu_mem_gb'], '.1f')} | {_num(s['train_mfu'], '.1%')} | "
                         f"{_num(s['gpu_idle_share'], '.1%')} |")
            if r.get("error"):
                lines.append(f"| ↳ partial: {r['error']} | | | | | | | | | |")
        lines.append("")
        idle_rows = [(r["trainer"], r["summary"]["gpu_idle_by_phase_s"]) for r in rows
                     if r.get("summary", {}).get("gpu_idle_by_phase_s")]
        if idle_rows:
            lines += ["GPU idle seconds per step by phase (phase seconds × (1 − NVML utilisation while it ran)):", "",
                      "| trainer | idle s by phase |", "| --- | --- |"]
            lines += [f"| {name} | " + ", ".join(f"{k} {v:.2f}" for k, v in idle.items()) + " |"
                      for name, idle in idle_rows]
            lines.append("")
    software = env.get("software", {})
    versions = ", ".join(f"{k} {software[k]}" for k in ("redline", "torch", "transformers", "SGLang", "trl",
                                                          "accelerate", "datasets") if k in software)
    lines += ["Tokens/s are per second of step time (a step: the rollout of every response, then one optimizer step",
              "over them). MFU: 6 × parameters × trained tokens / train-phase time over the board's bf16 dense peak.",
              "GPU idle: 1 − NVML utilisation over the step. Peak GPU memory: NVML, every process on the GPU.",
              "Every setting (each trainer's config) and version is in e2e.json.", "",
              f"GPU: {gpu_name(env)}; commit {env.get('commit')}; {versions}", "",
              "![tokens/s and step-time phases](e2e.png)", ""]
    return "\n".join(lines)


def _num(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def plot(results: list[dict], path: Path) -> None:
    """Trained and generated tokens/s per trainer, and each trainer's step time stacked by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "summary" in r]
    if not done:
        return
    labels = [f"{r['shape']}\n{r['trainer']}" for r in done]
    fig, (speed, stack) = plt.subplots(1, 2, figsize=(max(8, 2.4 * len(done)), 4))
    x = range(len(done))
    width = 0.4
    speed.bar([i - width / 2 for i in x], [r["summary"]["trained_tokens_per_s"] for r in done], width, label="trained")
    speed.bar([i + width / 2 for i in x], [r["summary"]["generated_tokens_per_s"] for r in done], width,
              label="generated")
    speed.set_ylabel("tokens / s of step time")
    speed.legend(fontsize=8)
    bottom = [0.0] * len(done)
    for phase in dict.fromkeys(k for r in done for k in r["summary"]["phases_s"]):
        values = [max(r["summary"]["phases_s"].get(phase, 0.0), 0.0) for r in done]
        stack.bar(list(x), values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    stack.set_ylabel("seconds per step")
    stack.legend(fontsize=7)
    for ax in (speed, stack):
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, env: dict) -> list[Path]:
    results = load_results(out)
    (out / "e2e.json").write_text(json.dumps({"environment": env, "results": results}, indent=2))
    (out / "e2e.md").write_text(markdown(results, env))
    plot(results, out / "e2e.png")
    return [p for p in (out / "e2e.json", out / "e2e.md", out / "e2e.png") if p.exists()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output folder")
    ap.add_argument("--shapes", default="qwen3-1.7b", help="built-in model shapes, comma-separated "
                    "(qwen3-1.7b, qwen3-4b, qwen3-8b)")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, of {', '.join(TRAINERS)}")
    ap.add_argument("--tiny", action="store_true", help="tiny model and batch, float32 (the CPU check)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 10; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps left out (default 2; --tiny 1)")
    ap.add_argument("--model-cache", type=Path, default=Path("/tmp/redline-e2e-models"),
                    help="where the built-in model folders are made once and reused")
    ap.add_argument("--trainer-timeout", type=float, default=None,
                    help="seconds one trainer may run; its finished steps still count")
    ap.add_argument("--redline-max-tokens-per-gpu", type=int, default=16384, help="redline's micro-batch budget")
    ap.add_argument("--redline-args", default="", help="more `redline train` flags for the redline trainers, "
                    "one string (e.g. \"--no-offload-train\"); recorded with the settings")
    ap.add_argument("--sglang-mem-fraction", type=float, default=None, help="redline-sglang's static memory share "
                    "(default: the loop's own, 0.7 beside the trainer --offload-train pauses)")
    ap.add_argument("--trl-micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size")
    ap.add_argument("--trl-generation-batch-size", type=int, default=None,
                    help="TRL's generation_batch_size (default: TRL's, the whole step's prompts x samples)")
    ap.add_argument("--trl-vllm-gpu-memory-utilization", type=float, default=0.55,
                    help="trl-vllm: vLLM's share of the GPU's memory (TRL's default is 0.3; the 1.7B shape's 512 "
                    "sequences of 1152 tokens need ~63 GiB of KV cache, which 0.55 of an H200 holds beside the "
                    "weights)")
    ap.add_argument("--trl-vllm-python", default=sys.executable,
                    help="trl-vllm: the Python that imports TRL and vLLM (default: this one; on the GPU machine "
                    "stage_peers.py's venv, /tmp/venv-vllm/bin/python3)")
    ap.add_argument("--report-only", action="store_true", help="only redraw OUT's table and plot")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        shlex.split(args.redline_args)
    except ValueError as exc:
        ap.error(f"--redline-args {args.redline_args!r}: {exc}")
    if not 0 < args.trl_vllm_gpu_memory_utilization <= 1:
        ap.error(f"--trl-vllm-gpu-memory-utilization must be in (0, 1], got {args.trl_vllm_gpu_memory_utilization}")
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    has_gpu = bool(env["gpus"].get("devices")) and not args.tiny
    if not args.report_only:
        trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
        unknown = [t for t in trainers if t not in TRAINERS]
        if unknown:
            ap.error(f"--trainers: unknown {', '.join(unknown)} (known: {', '.join(TRAINERS)})")
        base = dict(TINY) if args.tiny else {}
        shapes = ["tiny"] if args.tiny else [s.strip() for s in args.shapes.split(",") if s.strip()]
        for shape in shapes:
            workload = Workload(**(base | {"shape": shape} | {k: v for k, v in (("steps", args.steps),
                                                                                ("warmup", args.warmup)) if v}))
            model_dir = ensure_model(workload, args.model_cache, has_gpu)
            (args.out / shape).mkdir(exist_ok=True)
            prompts = write_prompts(args.out / shape / "prompts.jsonl", workload)
            for trainer in trainers:
                reason = unavailable(trainer, has_gpu, args.trl_vllm_python)
                if reason:
                    result = {"trainer": trainer, "shape": shape, "workload": dataclasses.asdict(workload),
                              "skipped": reason}
                    (args.out / shape / f"{trainer}.json").write_text(json.dumps(result, indent=2))
                    print(f"{shape} {trainer}: skipped ({reason})", flush=True)
                    continue
                print(f"{shape} {trainer}: running {workload.steps} steps after {workload.warmup} warm-up "
                      f"({workload.describe()})", flush=True)
                result = measure(trainer, workload, model_dir, prompts, args.out, args, env)
                s = result.get("summary")
                print(f"{shape} {trainer}: " + (f"{s['step_time_s']:.2f} s/step, {s['trained_tokens_per_s']:,.0f} "
                                                f"trained tok/s" if s else "no result") +
                      (f" ({result['error']})" if result.get("error") else ""), flush=True)
    for path in write_report(args.out, env):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
