"""redline in the end-to-end benchmark: the workload as a ``redline train`` config, run in its own process, and
its ``metrics.jsonl`` read back as ``StepRecord``s (GPU figures from the run's own NVML telemetry)."""

from __future__ import annotations

import json
from pathlib import Path

from e2e_workload import StepRecord, Workload

# perf/* phase metrics of redline's step (redline.loop.metrics.PHASES), named as the benchmark shows them
PHASES = {"perf/rollout_time": "rollout", "perf/offload_rollout_time": "offload", "perf/logprob_time": "logprob",
          "perf/train_time": "train", "perf/update_weights_time": "weight_sync", "perf/idle_time": "idle"}
# the run's NVML utilisation while each phase ran (redline.gpu_telemetry: perf/gpu_util/<phase of perf/<phase>_time>)
PHASE_UTIL = {key.replace("perf/", "perf/gpu_util/").removesuffix("_time"): name for key, name in PHASES.items()}


def config_toml(workload: Workload, *, model_dir: Path, prompts: Path, engine: str, max_tokens_per_gpu: int,
                sglang_mem_fraction: float | None, offload_rollout: bool) -> str:
    """A ``redline train`` TOML running ``workload`` on ``engine`` (embedded or sglang), colocated;
    ``sglang_mem_fraction`` None leaves SGLang's share to the loop (``rollout_setup.sglang_mem_fraction``)."""
    sections = {
        "model": {"hf_checkpoint": str(model_dir), "backend": "bf16", "dtype": workload.dtype},
        "data": {"prompt_data": str(prompts), "label_key": "label", "rollout_max_prompt_len": workload.prompt_len,
                 "rollout_shuffle": False},
        "rollout": {"rollout_engine": engine, "num_rollout": workload.warmup + workload.steps,
                    "rollout_batch_size": workload.prompts, "n_samples_per_prompt": workload.samples,
                    "rollout_max_response_len": workload.response_len, "rollout_ignore_eos": True,
                    "rollout_temperature": workload.temperature, "custom_rm_path": "e2e_workload:digit_share",
                    "sglang_mem_fraction_static": sglang_mem_fraction},
        "algo": {"advantage_estimator": "grpo"},
        "train": {"global_batch_size": workload.samples_per_step, "num_steps_per_rollout": 1,
                  "max_tokens_per_gpu": max_tokens_per_gpu, "lr": workload.lr, "seed": workload.seed},
        "sync": {"offload_rollout": offload_rollout},
        "checkpoint": {"run_name": f"e2e-{workload.shape}-{engine}"},
    }
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items() if value is not None]
        lines.append("")
    return "\n".join(lines)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return repr(value)


def read_records(metrics_jsonl: Path, workload: Workload) -> list[StepRecord]:
    """One ``StepRecord`` per RL step of a run's ``metrics.jsonl`` (records without ``perf/step_time`` are not
    steps). Trained tokens are ``perf/tokens_per_gpu_per_sec × perf/train_time``, the count the step divided."""
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    records = []
    for row in sorted((r for r in rows if "perf/step_time" in r), key=lambda r: r["step"]):
        length = row["rollout/response_len_mean"]
        records.append(StepRecord(
            step_time=row["perf/step_time"], train_time=row["perf/train_time"],
            generated_tokens=round(length * workload.samples_per_step),
            trained_tokens=round(row["perf/tokens_per_gpu_per_sec"] * row["perf/train_time"]),
            phases={name: row[key] for key, name in PHASES.items() if key in row},
            gpu_util=row.get("perf/gpu_util"), gpu_mem_gb=row.get("perf/gpu_mem_gb"), response_len_mean=length,
            phase_gpu_util={name: row[key] for key, name in PHASE_UTIL.items() if key in row}))
    return records
