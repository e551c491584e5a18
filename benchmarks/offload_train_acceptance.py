"""Issue 16's ``--offload-train`` acceptance on one GPU, from the loop's own metrics, in one command:

    python3 benchmarks/offload_train_acceptance.py OUTDIR [--shapes qwen3-1.7b,qwen3-4b] [--steps 4]
        [--modes no-offload-train,offload-train,...] [--extra "--rollout-engine sglang ..."] [--tag=-NAME]

1. builds redline's native library (``cmake`` into ``build/native``; the VMM allocator behind PausableMemory)
   and points every run at it (``REDLINE_NATIVE_LIBRARY``): an older library on the machine lacks
   ``redline_vmm_pause_some``;
2. per shape (a built-in model with that Qwen3 config and random bf16 weights, made once in OUTDIR/models/
   or ``--models``), ``redline train examples/qwen3_1p7b_breakdown.toml`` colocated with the in-process embedded engine,
   ``--backend bf16 --offload-rollout`` (fp32 master weights and AdamW moments on the GPU; the 4B shape with
   ``--optimizer-cpu-offload --recompute full --max-tokens-per-gpu 4096``: its 72 GB of state on the GPU did not
   fit beside the engine on 80 GB, so its masters and moments live in pinned host memory in every mode and
   ``--offload-train`` pauses the compute weights and gradients), ``--steps`` RL steps each, with
   ``--no-offload-train``, with ``--offload-train --offload-train-optimizer host`` and with
   ``--offload-train --offload-train-optimizer gpu`` (what the GPU cannot rebuild stays resident: masters and
   moments, or at 4B the compute weights; the plan's other choice); a run that fails or passes ``--run-timeout``
   is reported as such, with its last error line;
3. writes OUTDIR/<shape>-<mode>/ (metrics.jsonl, report.md with the phase plot), OUTDIR/<shape>-<mode>.log,
   OUTDIR/summary.md and OUTDIR/summary.json: per run the medians over the steps after the first of every
   phase of the colocated transition (release → resume train → … → pause train → resume engine weights →
   sync → resume KV), ``perf/trainer_paused_bytes`` (the paused trainer's GPU memory),
   ``perf/kv_headroom_bytes`` (free GPU memory as the engine takes its KV cache back: what an engine that
   sizes its cache by free memory, as SGLang does, would get), the embedded engine's KV cache (its rows ×
   slots, fixed by the config), and the transition against the sync alone (the issue's target with SGLang:
   ≤ 2× the sync); then the plan's cost group by group: each group's bytes (the start-up plan table of the
   run's log) and its measured pause (``perf/pause_train_<group>_time``), and the resume's two parts (mapping
   back with the kept contents copied in, the compute weights' rebuild). OUTDIR/summary.* are rewritten after
   every run, so a call cut short keeps what it finished.

``--modes`` picks the runs (``offload-train-auto`` is the default plan, decided at start-up) and ``--extra`` adds
flags to each (``--rollout-engine sglang`` with the workload's sizes: ``benchmarks/sglang_colocated_acceptance.sh``);
``--tag`` keeps one call's runs apart from another's in the same OUTDIR. With SGLang, the KV cache is what the
server's log says it allocated (tokens and bytes), and a second table sets the update phase and the sync against
SGLang's own handling inside them (``perf/update_weights_sglang_time``, ``perf/sync_sglang_time``).

The kernel warm-up is off (``REDLINE_KERNEL_WARMUP=0``) to keep the runs short: step 1 pays the compilation and
is left out of the medians. Each call adds its runs to OUTDIR/summary.md (one shape per call keeps each call
short). ``--config`` and ``--shapes`` take any TOML and built-in model (the CPU smoke test
runs ``tiny``: the run without offload completes, the one with it is refused at start-up for want of a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from redline.env_report import write_environment

ROOT = Path(__file__).resolve().parents[1]
# the third mode keeps what the GPU cannot rebuild resident (masters and moments, whose copies to and from pinned
# host are most of the pause and resume; with --optimizer-cpu-offload the compute weights): the plan's other
# choice, measured in the same call
MODES = {"no-offload-train": ["--no-offload-train"],
         "offload-train": ["--offload-train", "--offload-train-optimizer", "host"],
         "offload-train-optimizer-gpu": ["--offload-train", "--offload-train-optimizer", "gpu"],
         "offload-train-auto": ["--offload-train"]}  # the default plan: measured at start-up
DEFAULT_MODES = "no-offload-train,offload-train,offload-train-optimizer-gpu"
# colocated SGLang: its own handling inside the update phase and the sync (redline.loop.weight_sync)
SGLANG = ("perf/update_weights_sglang_time", "perf/sync_sglang_time")
SGLANG_KV = re.compile(r"KV Cache is allocated\. .*#tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB")
TRANSITION = ("perf/release_time", "perf/resume_train_time", "perf/pause_train_time", "perf/resume_weights_time",
              "perf/sync_time", "perf/check_weights_time", "perf/resume_kv_time")
TOTALS = ("perf/offload_rollout_time", "perf/update_weights_time", "perf/rollout_time", "perf/train_time",
          "perf/logprob_time", "perf/step_time")
BYTES = ("perf/trainer_paused_bytes", "perf/kv_headroom_bytes")
# the plan's cost (redline.loop.train_offload.TrainOffload.timings): each group's pause, the resume's two parts
GROUPS = ("perf/pause_train_grads_time", "perf/pause_train_masters_time", "perf/pause_train_moments_time",
          "perf/pause_train_compute_time", "perf/pause_train_cache_time", "perf/resume_train_map_time",
          "perf/resume_train_rebuild_time")
PLAN_TITLE = "--offload-train, while the engine generates:"  # the start-up plan table's heading in a run's log
# the 4B trainer's state is 72 GB (bf16 weights, fp32 grads, masters, two moments): on an 80 GB GPU beside the
# engine every mode ran out of memory at start-up, so its masters and moments go to pinned host memory, and its
# activations are kept small
SHAPE_FLAGS = {"qwen3-4b": ["--optimizer-cpu-offload", "--recompute", "full", "--max-tokens-per-gpu", "4096"]}


def build_native(out: Path) -> dict[str, str]:
    """The environment that points runs at a freshly built native library (the installed one when no CUDA
    toolkit is here to build it)."""
    if shutil.which("cmake") and (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        build = ROOT / "build" / "native"
        for command in (["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
                        ["cmake", "--build", str(build), "-j", "8"]):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            (out / "native-build.log").open("a").write(done.stdout + done.stderr)
            if done.returncode != 0:
                sys.exit(f"building the native library failed ({' '.join(command)}); see {out / 'native-build.log'}")
        print(f"native library: built {build / 'libredline_native.so'}")
        return {"REDLINE_NATIVE_LIBRARY": str(build / "libredline_native.so")}
    print("native library: no cmake/nvcc here; the runs use the installed one (--offload-train refuses to start "
          "when it is missing or out of date, saying how to build it)")
    return {}


def make_model(folder: Path, name: str) -> None:
    """The built-in model ``name`` (random bf16 weights) as an HF folder, in a child process (this one keeps no
    GPU memory)."""
    if (folder / "config.json").is_file():
        return
    code = ("import sys, torch; from pathlib import Path; from redline.loop.builtin import builtin_model; "
            "builtin_model(Path(sys.argv[1]), sys.argv[2], dtype=torch.bfloat16, "
            "device='cuda' if torch.cuda.is_available() else 'cpu')")
    subprocess.run([sys.executable, "-c", code, str(folder), name], check=True)


def train(out: Path, run: str, config: str, model: Path, steps: int, flags: list[str], env: dict[str, str],
          timeout_s: float) -> dict:
    """One ``redline train`` (killed after ``timeout_s``); returns ``{"ok": bool, "error": last error line,
    "flags": [...], "plan": the start-up plan table's lines}``."""
    command = [sys.executable, "-m", "redline.cli", "train", config, "--hf-checkpoint", str(model),
               "--backend", "bf16", "--num-rollout", str(steps), "--offload-rollout", *flags,
               "--output-dir", str(out / run), "--overwrite"]
    log = out / f"{run}.log"
    print(f"{run}: {' '.join(command[2:])}", flush=True)
    with log.open("w") as sink:
        try:
            code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
                                  env={**os.environ, "COLUMNS": "200", "REDLINE_KERNEL_WARMUP": "0", **env}).returncode
        except subprocess.TimeoutExpired:
            code = None
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Error" in line]
    error = (f"timed out after {timeout_s:.0f} s" if code is None else ""
             if code == 0 else (errors[-1] if errors else f"exit status {code}"))
    return {"ok": code == 0, "error": error, "flags": flags, "plan": plan_table(lines)}


def plan_table(lines: list[str]) -> list[str]:
    """The start-up plan table (markdown rows after ``PLAN_TITLE``) of a run's log; [] without one."""
    if PLAN_TITLE not in lines:
        return []
    rows = lines[lines.index(PLAN_TITLE) + 1:]
    return rows[:next((i for i, row in enumerate(rows) if not row.startswith("|")), len(rows))]


def kv_cache_bytes(config_path: str, model: Path) -> int:
    """The embedded engine's KV cache: K and V of every layer for its rows × slots, bf16."""
    from redline.config import RunConfig
    from redline.configfile import load_toml
    from redline.loop.rollout_setup import engine_rows, engine_seq_len

    config = load_toml(RunConfig, config_path)
    hf = json.loads((model / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    slots = engine_seq_len(config, hf.get("max_position_embeddings", 4096))
    return 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * engine_rows(config) * slots * 2


def sglang_kv_cache(run_dir: Path) -> dict | None:
    """What the run's SGLang server allocated for its KV cache (its log's line): ``{"tokens", "bytes"}``; None
    for a run without one."""
    for log in sorted((run_dir / "logs").glob("**/sglang-*.log")):
        match = SGLANG_KV.search(log.read_text(errors="replace"))
        if match:
            return {"tokens": int(match[1]), "bytes": int((float(match[2]) + float(match[3])) * 2**30)}
    return None


def medians(run_dir: Path) -> dict[str, float]:
    """Medians over the steps after the first of the transition's phases, the step totals and the byte metrics."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if "perf/update_weights_time" in r]
    steady = rows[1:] or rows
    out = {key: statistics.median(r[key] for r in steady) for key in TRANSITION + TOTALS + BYTES + GROUPS + SGLANG
           if steady and all(key in r for r in steady)}
    out["steps"] = len(rows)
    return out


def ms(seconds) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def gib(nbytes) -> str:
    return "–" if nbytes is None else f"{nbytes / 2**30:.2f}"


def summary(out: Path, results: dict) -> str:
    phases = " | ".join(k.removeprefix("perf/").removesuffix("_time") for k in TRANSITION)
    lines = ["# `--offload-train` in `redline train` (colocated engine, --offload-rollout)", "",
             ("Medians of the steps after the first; ms unless marked. transition = perf/offload_rollout_time + "
              "perf/update_weights_time (release → resume train → … → pause train → resume engine weights → sync → "
              "resume KV); the issue's target with SGLang: transition ≤ 2× the sync alone."), "",
             (f"| run | ok | {phases} | transition | transition / sync | trainer paused (GiB) | KV headroom (GiB) "
              "| engine KV cache (GiB) | KV tokens | step (s) |"),
             "| --- | --- |" + " ---: |" * (len(TRANSITION) + 7)]
    for run, result in results.items():
        m = result["medians"]
        transition = (m["perf/offload_rollout_time"] + m["perf/update_weights_time"]
                      if "perf/update_weights_time" in m and "perf/offload_rollout_time" in m else None)
        ratio = f"{transition / m['perf/sync_time']:.2f}×" if transition and m.get("perf/sync_time") else "–"
        result["transition_s"] = transition
        cells = [ms(m.get(k)) for k in TRANSITION]
        step = f"{m['perf/step_time']:.2f}" if "perf/step_time" in m else "–"
        ok = "yes" if result["ok"] else f"no: {result['error'][:160]}"
        lines.append(f"| {run} `{' '.join(result['flags'])}` | {ok} | " + " | ".join(cells)
                     + f" | {ms(transition)} | {ratio} | {gib(m.get('perf/trainer_paused_bytes'))} | {gib(m.get('perf/kv_headroom_bytes'))} | "
                     f"{gib(result['kv_cache_bytes'])} | {result.get('kv_tokens') or '–'} | {step} |")
    sglang = {run: r for run, r in results.items() if "perf/update_weights_sglang_time" in r["medians"]}
    if sglang:
        lines += ["", ("Colocated SGLang: its own handling (the seconds the push waited on the servers' answers: "
                       "memory resume, weight updates, /weights_checker) against the whole update phase and the "
                       "sync (medians, ms); the issue's target: perf/update_weights_time ≤ 1.2× SGLang's handling."),
                  "", "| run | update_weights | SGLang's handling in it | ratio | sync | SGLang's handling in it | ratio |",
                  "| --- |" + " ---: |" * 6]
        for run, result in sglang.items():
            m = result["medians"]
            update, handled = m["perf/update_weights_time"], m["perf/update_weights_sglang_time"]
            sync, sync_handled = m["perf/sync_time"], m["perf/sync_sglang_time"]
            lines.append(f"| {run} | {ms(update)} | {ms(handled)} | {update / handled:.2f}× | {ms(sync)} | "
                         f"{ms(sync_handled)} | {sync / sync_handled:.2f}× |")
    lines += ["", ("The plan's cost, group by group (medians, ms): each group's pause (its copies to pinned host "
                   "waited for), the caching allocator's empty_cache, and the resume's two parts."), "",
              "| run | " + " | ".join(k.removeprefix("perf/").removesuffix("_time") for k in GROUPS) + " |",
              "| --- |" + " ---: |" * len(GROUPS)]
    for run, result in results.items():
        if result.get("plan"):
            lines.append(f"| {run} | " + " | ".join(ms(result["medians"].get(k)) for k in GROUPS) + " |")
    for run, result in results.items():
        if result.get("plan"):
            lines += ["", f"{run}: the plan (start-up line of its log)", "", *result["plan"]]
    lines += ["", ("Per-step values: OUTDIR/<run>/metrics.jsonl; the phase plot: OUTDIR/<run>/phase_times.png; the "
                   "memory table of the training state and the offload plan: OUTDIR/<run>.log.")]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", default="qwen3-1.7b,qwen3-4b", help="built-in models, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--config", default=str(ROOT / "examples" / "qwen3_1p7b_breakdown.toml"))
    parser.add_argument("--models", type=Path, default=None,
                        help="where the built-in models are made (default OUTDIR/models; 3.4 GB and 8 GB)")
    parser.add_argument("--extra", default="", help="more `redline train` flags for every run, one string")
    parser.add_argument("--run-timeout", type=float, default=900, help="seconds before a run is killed")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--tag", default="", help="appended to each run's name (one call's runs beside another's)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    out = args.out.resolve()
    write_environment(out)  # device, versions, date, commit beside the summary
    env = build_native(out)
    earlier = out / "summary.json"  # runs of an earlier call into the same folder (one shape per call) stay listed
    results = json.loads(earlier.read_text()) if earlier.is_file() else {}
    for shape in args.shapes.split(","):
        model = (args.models or out / "models").resolve() / shape
        make_model(model, shape)
        for mode in modes:
            run = f"{shape}-{mode}{args.tag}"
            flags = [*MODES[mode], *SHAPE_FLAGS.get(shape, []), *args.extra.split()]
            result = train(out, run, args.config, model, args.steps, flags, env, args.run_timeout)
            sglang_kv = sglang_kv_cache(out / run)  # a SGLang run that failed before allocating has none
            embedded = "sglang" not in flags
            result.update(medians=medians(out / run), kv_tokens=sglang_kv and sglang_kv["tokens"],
                          kv_cache_bytes=(sglang_kv["bytes"] if sglang_kv else
                                          kv_cache_bytes(args.config, model) if embedded else None))
            results[run] = result
            summary(out, results)
    print(summary(out, results))
    return 0 if any(results.get(f"{shape}-{mode}{args.tag}", {}).get("ok") for shape in args.shapes.split(",")
                    for mode in modes) else 1


if __name__ == "__main__":
    sys.exit(main())
