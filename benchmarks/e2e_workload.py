"""The end-to-end benchmark's workload, the same for every trainer, and the numbers made of each trainer's steps.

Nothing here imports torch at module level: ``digit_share`` is loaded as the reward by every ``redline train``
process the benchmark starts (``--custom-rm-path e2e_workload:digit_share``).

A trainer reports one ``StepRecord`` per optimizer step (one rollout of ``prompts × samples`` responses, one
optimizer step over all of them); ``summarize`` turns the measured ones into the benchmark's row.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPT_CHARACTERS = "0123456789+-*="  # the built-in models' character tokenizer: one token per character
# bf16 dense tensor-core peak of the board (TFLOP/s), the MFU denominator; NVML's name is matched by substring
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0, "A100": 312.0, "B200": 2250.0}


@dataclass(frozen=True)
class Workload:
    """One GRPO workload. ``shape``: a built-in model of ``redline.loop.builtin.MODELS`` (random weights)."""

    shape: str = "qwen3-1.7b"
    prompts: int = 64  # per step
    samples: int = 8  # per prompt
    prompt_len: int = 128  # tokens, every prompt
    response_len: int = 1024  # tokens, every response (EOS ignored)
    steps: int = 10  # measured
    warmup: int = 2  # steps run first and left out
    lr: float = 1e-6
    dtype: str = "bfloat16"
    seed: int = 1
    temperature: float = 1.0

    @property
    def samples_per_step(self) -> int:
        return self.prompts * self.samples

    def describe(self) -> str:
        """The workload per step (trainers run into one folder may differ in their number of steps)."""
        return (f"Qwen3 shape {self.shape}, random weights, {self.prompts} prompts x {self.samples} samples of "
                f"{self.prompt_len} + {self.response_len} tokens (EOS ignored), GRPO, {self.dtype}, lr {self.lr:g}")


TINY = dict(shape="tiny", prompts=4, samples=4, prompt_len=8, response_len=16, steps=2, warmup=1, dtype="float32")


def write_prompts(path: Path, workload: Workload) -> Path:
    """JSONL of every prompt the run will draw (``prompts × (steps + warmup)``), each ``prompt_len`` characters of
    arithmetic; the same file feeds every trainer."""
    rng = random.Random(workload.seed)
    count = workload.prompts * (workload.steps + workload.warmup)
    lines = [json.dumps({"prompt": "".join(rng.choice(PROMPT_CHARACTERS) for _ in range(workload.prompt_len)),
                         "label": ""}) for _ in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def digit_share_of(text: str) -> float:
    """The share of ``text``'s characters that are decimal digits (0 for empty text): a reward that costs nothing
    and varies within a group, so GRPO's advantages are not all zero."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


async def digit_share(sample) -> float:
    """``redline train``'s reward (``--custom-rm-path e2e_workload:digit_share``)."""
    return digit_share_of(sample.response)


@dataclass
class StepRecord:
    """One optimizer step as a trainer reports it. Times in seconds; GPU figures from NVML over the step."""

    step_time: float
    train_time: float  # the phase that runs forward + backward + optimizer over the batch
    generated_tokens: int
    trained_tokens: int  # prompt + response tokens the loss saw
    phases: dict[str, float] = field(default_factory=dict)  # adds up to step_time
    gpu_util: float | None = None  # mean %, NVML
    gpu_mem_gb: float | None = None  # peak, every process on the GPU
    response_len_mean: float | None = None
    phase_gpu_util: dict[str, float] = field(default_factory=dict)  # mean NVML % while each phase ran


def peak_tflops(gpu_name: str | None) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if gpu_name and k in gpu_name), None)


def summarize(records: list[StepRecord], workload: Workload, num_parameters: int,
              gpu_name: str | None = None) -> dict:
    """The benchmark's numbers over the measured steps (the ``warmup`` first records are dropped):

    step time (mean s), generated and trained tokens per second of step time, mean seconds per phase, peak GPU
    memory (GB, NVML), train-phase MFU (``6 · num_parameters · trained tokens / train time`` over the board's bf16
    peak), and the GPU's idle share (``1 − mean utilisation``, weighted by step time)."""
    measured = records[workload.warmup:]
    if not measured:
        raise ValueError(f"{len(records)} steps recorded, none past the {workload.warmup} warm-up steps")
    total = sum(r.step_time for r in measured)
    train = sum(r.train_time for r in measured)
    trained = sum(r.trained_tokens for r in measured)
    phases = {name: sum(r.phases.get(name, 0.0) for r in measured) / len(measured)
              for name in dict.fromkeys(k for r in measured for k in r.phases)}
    peak = peak_tflops(gpu_name)
    train_tflops = 6 * num_parameters * trained / train / 1e12
    with_util = [r for r in measured if r.gpu_util is not None]
    busy = sum(r.gpu_util * r.step_time for r in with_util) / sum(r.step_time for r in with_util) if with_util else None
    mems = [r.gpu_mem_gb for r in measured if r.gpu_mem_gb is not None]
    lengths = [r.response_len_mean for r in measured if r.response_len_mean is not None]
    idle_by_phase = {name: sum(r.phases.get(name, 0.0) * (1 - r.phase_gpu_util[name] / 100) for r in measured
                               if name in r.phase_gpu_util) / len(measured)
                     for name in dict.fromkeys(k for r in measured for k in r.phase_gpu_util)}
    return {
        "steps": len(measured),
        "step_time_s": total / len(measured),
        "generated_tokens_per_s": sum(r.generated_tokens for r in measured) / total,
        "trained_tokens_per_s": trained / total,
        "train_phase_tokens_per_s": trained / train,
        "phases_s": phases,
        "peak_gpu_mem_gb": max(mems) if mems else None,
        "train_tflops": train_tflops,
        "train_mfu": train_tflops / peak if peak else None,
        "gpu_idle_share": 1 - busy / 100 if busy is not None else None,
        "gpu_idle_by_phase_s": idle_by_phase,
        "response_len_mean": sum(lengths) / len(lengths) if lengths else None,
        "step_times_s": [r.step_time for r in records],
    }


def records_to_json(records: list[StepRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def records_from_json(rows: list[dict]) -> list[StepRecord]:
    return [StepRecord(**row) for row in rows]
