"""TRL's ``GRPOTrainer`` in the end-to-end benchmark: with its default generation (``transformers`` ``generate``),
or, when SPEC holds ``"vllm"``, with vLLM colocated in the trainer's process (``use_vllm``, ``vllm_mode="colocate"``).

Run by ``bench_e2e.py`` in its own process: ``python e2e_trl.py SPEC.json`` reads the workload, model folder,
prompts and output path from SPEC and writes ``{"records": [...], ...}`` there. Each optimizer step covers one
generation round of ``prompts × samples`` completions (``steps_per_generation`` = gradient-accumulation steps,
TRL's default), so it is the same unit of work as one redline step. Responses are held at their fixed length
with ``min_new_tokens`` (``generate``) or ``min_tokens`` (vLLM's ``SamplingParams``): EOS is masked until then.
Phases are timed by wrapping TRL's own methods, with a device sync at each boundary: ``generate``
(``_generate``), ``weight_sync`` (vLLM only: ``sync_weights``, which TRL calls inside ``_generate``; left out of
``generate``), ``score`` (the rest of ``_generate_and_score_completions``: rewards, advantages, any
old/reference log-probs) and ``train`` (the rest of the step: forward, backward, optimizer).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from e2e_workload import StepRecord, Workload, digit_share_of, records_to_json


def trl_reward(completions, **kwargs) -> list[float]:
    """The workload's reward in TRL's signature (plain-text completions)."""
    return [digit_share_of(c) for c in completions]


def grpo_settings(spec: dict, *, cuda: bool) -> dict:
    """``trl.GRPOConfig`` keyword arguments running SPEC's workload. With ``spec["vllm"]``
    (``{"gpu_memory_utilization": share}``) generation runs on vLLM colocated in this process, its KV cache in
    ``share`` of the GPU's memory and its context the workload's prompt + response length."""
    workload = Workload(**spec["workload"])
    micro = spec["per_device_train_batch_size"]
    if workload.samples_per_step % micro:
        raise ValueError(f"--trl-micro-batch {micro} does not divide the {workload.samples_per_step} samples of a step")
    settings = dict(
        output_dir=str(Path(spec["out"]).parent / "trl-output"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=workload.samples_per_step // micro, num_generations=workload.samples,
        max_completion_length=workload.response_len, generation_kwargs={"min_new_tokens": workload.response_len},
        temperature=workload.temperature, learning_rate=workload.lr, lr_scheduler_type="constant",
        max_steps=workload.warmup + workload.steps, logging_steps=1, save_strategy="no", report_to=[],
        bf16=cuda and workload.dtype == "bfloat16", use_cpu=not cuda, seed=workload.seed, dataloader_num_workers=0)
    if spec.get("vllm"):
        settings |= dict(use_vllm=True, vllm_mode="colocate",
                         vllm_gpu_memory_utilization=spec["vllm"]["gpu_memory_utilization"],
                         vllm_max_model_length=workload.prompt_len + workload.response_len,
                         generation_kwargs={"min_tokens": workload.response_len})
    if spec.get("generation_batch_size"):
        settings["generation_batch_size"] = spec["generation_batch_size"]
    return settings


def main(spec_path: str) -> None:
    import torch
    import trl
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from redline.extras import version
    from redline.gpu_telemetry import open_gpu_telemetry

    spec = json.loads(Path(spec_path).read_text())
    workload = Workload(**spec["workload"])
    out = Path(spec["out"])
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, workload.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    phase_times: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(name: str):
        sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync()
            phase_times[name] = phase_times.get(name, 0.0) + time.perf_counter() - start

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate(self, *args, **kwargs):
            with timed("generate"):
                return super()._generate(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            with timed("generate_and_score"):
                return super()._generate_and_score_completions(*args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    dataset = load_dataset("json", data_files=spec["prompts"], split="train")
    settings = grpo_settings(spec, cuda=cuda)
    config = trl.GRPOConfig(**settings)
    records: list[StepRecord] = []
    about = {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "settings": {k: (v if isinstance(v, (int, float, str, bool, dict, type(None))) else str(v))
                     for k, v in settings.items()} | {
            "steps_per_generation": config.steps_per_generation, "generation_batch_size": config.generation_batch_size,
            "gradient_checkpointing": config.gradient_checkpointing, "loss_type": config.loss_type,
            "beta": config.beta, "optim": str(config.optim), "attn_implementation": model.config._attn_implementation},
        "versions": {name: version(name)
                     for name in ("trl", "transformers", "accelerate", "datasets", "torch", "vllm")},
    }

    def save() -> None:
        """Rewritten after every step: a run stopped by --trainer-timeout keeps the steps it finished."""
        out.write_text(json.dumps(about | {
            "records": records_to_json(records),
            "torch_peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}, indent=2))

    telemetry = open_gpu_telemetry([torch.device("cuda", torch.cuda.current_device())] if cuda else [], print)

    class StepClock(TrainerCallback):
        """A record per optimizer step: device-synced wall time, TRL's phases inside it, NVML over it."""

        tokens_before = 0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            phase_times.clear()
            telemetry.begin()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            step_time = time.perf_counter() - self.start
            gpu = telemetry.summary()
            generate = phase_times.get("generate", 0.0)
            score = phase_times.get("generate_and_score", 0.0) - generate
            train = step_time - generate - score
            phases = {"generate": generate, "score": score, "train": train}
            if config.use_vllm:
                phases["weight_sync"] = phase_times.get("weight_sync", 0.0)
                phases["generate"] -= phases["weight_sync"]
            records.append(StepRecord(step_time=step_time, train_time=train, generated_tokens=0, trained_tokens=0,
                                      phases=phases,
                                      gpu_util=gpu.get("perf/gpu_util"), gpu_mem_gb=gpu.get("perf/gpu_mem_gb")))

        def on_log(self, args, state, control, logs=None, **kwargs):
            # just after on_step_end (logging_steps=1) TRL logs the step's mean completion length and its running
            # count of input tokens (prompt + completion, from the attention masks)
            if records and logs and "completions/mean_length" in logs:
                length = float(logs["completions/mean_length"])
                tokens = int(float(logs["num_tokens"]))
                records[-1].response_len_mean = length
                records[-1].generated_tokens = round(length * workload.samples_per_step)
                records[-1].trained_tokens = tokens - self.tokens_before
                self.tokens_before = tokens
                save()

    trainer = TimedGRPOTrainer(model=model, reward_funcs=trl_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepClock()])
    if config.use_vllm:
        sync_weights = trainer.vllm_generation.sync_weights

        def timed_sync_weights():
            with timed("weight_sync"):
                sync_weights()

        trainer.vllm_generation.sync_weights = timed_sync_weights
    with telemetry:
        trainer.train()
    save()


if __name__ == "__main__":
    main(sys.argv[1])  # run as a script: its folder (e2e_workload) is first on sys.path
