"""TRL ``GRPOTrainer``'s loss computation at the Qwen3-1.7B shape: TRL's own, with ``use_redline_kernels``, and with
Liger's ``LigerFusedLinearGRPOLoss`` (``use_liger_kernel=True``), one sitting.

    python3 benchmarks/bench_trl_loss.py OUT_DIR [--completions 8 --prompt-len 256 --completion-len 2048]

For each provider: a fresh ``Qwen3ForCausalLM`` (random weights, bf16, built from a transformers config, the same
seed), a ``GRPOTrainer`` around it, one generated batch made up on the device (the same for every provider:
off-policy old log-probs given, so every provider computes the same loss), then ``trainer.compute_loss`` +
``backward`` — the whole training step minus the optimizer: backbone forward, LM head, loss, backward. Reported:
median step time over ``--steps`` timed steps after ``--warmup``, and the peak memory of one step beyond what was
allocated before it (weights, gradients, batch). The loss and the LM-head gradient norm are recorded per provider
as a cross-check (bf16: they agree to a few parts in 1e3).

Liger's GRPO loss is TRL's ``use_liger_kernel=True`` in TRL <= 1.12; from 1.13 TRL computes its log-probs itself
(1.16: a chunked fused head of its own), so the Liger row is recorded as skipped there. TRL 1.12 needs the
``trl-1.12`` bundle of /work/shared/device/stage.py and Liger the ``anchors`` bundle. ``--tiny`` runs a tiny model on
the CPU (no Liger) to check the script.
"""

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1000000.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
# Liger's GRPO loss alone: its layer kernels (RMSNorm, SwiGLU, RoPE), which Trainer would also patch in, stay off
# so that only the loss computation differs between the rows
LIGER_LOSS_ONLY = {"use_liger_kernel": True, "liger_kernel_config": {
    "rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False, "fused_linear_cross_entropy": False}}
PROVIDERS = ("trl", "trl + redline (use_redline_kernels)", "trl + liger (use_liger_kernel=True)")


def tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t1", eos_token="t2", unk_token="t0")


def liger_unavailable() -> str | None:
    """Why the Liger row cannot run here, or None."""
    import trl.trainer.grpo_trainer as grpo

    if not hasattr(grpo.GRPOTrainer, "compute_liger_loss"):
        return f"TRL {__import__('trl').__version__} has no Liger GRPO loss (TRL <= 1.12 has; stage 'trl-1.12')"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (stage 'anchors')"
    return None


def make_batch(args, vocab_size: int, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    n, p, c = args.completions, args.prompt_len, args.completion_len
    completion_mask = torch.ones(n, c, dtype=torch.long)
    lengths = torch.randint(c // 2, c + 1, (n,), generator=g)
    completion_mask[torch.arange(c)[None, :] >= lengths[:, None]] = 0
    batch = {"prompt_ids": torch.randint(3, vocab_size, (n, p), generator=g),
             "prompt_mask": torch.ones(n, p, dtype=torch.long),
             "completion_ids": torch.randint(3, vocab_size, (n, c), generator=g), "completion_mask": completion_mask,
             "advantages": torch.randn(n, generator=g),
             "old_per_token_logps": -torch.rand(n, c, generator=g) * 8 - 4,
             "num_items_in_batch": completion_mask.sum().float()}
    return {k: v.to(device) for k, v in batch.items()}


def run_provider(name: str, args, shape: dict, device) -> dict:
    import datasets
    import trl
    from redline.kernels.integrations.trl import use_redline_kernels
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype)
    config = trl.GRPOConfig(output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=args.completions,
                            num_generations=args.completions, max_completion_length=args.completion_len,
                            loss_type=args.loss_type, bf16=not args.tiny, use_cpu=device.type == "cpu",
                            report_to=[], save_strategy="no", gradient_checkpointing=args.gradient_checkpointing,
                            **(LIGER_LOSS_ONLY if name == PROVIDERS[2] else {}))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=config, train_dataset=datasets.Dataset.from_dict({"prompt": ["t3 t4"] * 8}),
                              processing_class=tokenizer(shape["vocab_size"]))
    if name == PROVIDERS[1]:
        use_redline_kernels(trainer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    batch = make_batch(args, shape["vocab_size"], device)
    head = trainer.model.get_output_embeddings().weight

    def step():
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        return loss

    cuda = device.type == "cuda"
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        trainer.model.zero_grad(set_to_none=False)  # gradients stay allocated: the peak is the step's own
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    row = {"provider": name, "step_ms": 1e3 * statistics.median(times), "step_ms_all": [1e3 * t for t in times],
           "loss": loss.item(), "lm_head_grad_norm": head.grad.float().norm().item()}
    if cuda:
        row["peak_step_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return row  # the trainer and model go with this frame; main frees their memory before the next provider


def write_results(out: Path, environment: dict, rows: list[dict]) -> None:
    (out / "bench_trl_loss.json").write_text(json.dumps({"environment": environment, "rows": rows}, indent=2))
    lines = [f"# TRL GRPOTrainer loss computation ({environment['shape']}, {environment['tokens']})", "",
             " ".join(f"{k}={v}" for k, v in environment.items() if k not in ("shape", "tokens")), "",
             "| provider | step ms (median) | peak step memory MiB | loss | LM-head grad norm |",
             "| --- | --- | --- | --- | --- |"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['provider']} | skipped: {row['skipped']} | | | |")
            continue
        peak = f"{row['peak_step_mib']:.0f}" if "peak_step_mib" in row else "n/a (CPU)"
        lines.append(f"| {row['provider']} | {row['step_ms']:.1f} | {peak} | {row['loss']:.6g} | "
                     f"{row['lm_head_grad_norm']:.6g} |")
    (out / "bench_trl_loss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for bench_trl_loss.json and bench_trl_loss.md")
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=2048)
    ap.add_argument("--loss-type", default="dapo", choices=("grpo", "dapo", "bnpo", "dr_grpo"))
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                    help="TRL's default checkpoints the decoder layers, leaving the LM head and loss to dominate")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU: checks the script")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers
    import trl

    device = torch.device("cpu" if args.tiny else "cuda")
    shape = TINY if args.tiny else QWEN3_1_7B
    environment = {"shape": "tiny (CPU check)" if args.tiny else "Qwen3-1.7B, bf16, random weights",
                   "tokens": f"{args.completions} completions x ({args.prompt_len} prompt + {args.completion_len} "
                             f"completion tokens)",
                   "loss_type": args.loss_type, "trl": trl.__version__, "transformers": transformers.__version__,
                   "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else
                   "cpu", "gradient_checkpointing": args.gradient_checkpointing}
    rows = []
    for name in PROVIDERS:
        reason = "CPU check runs no Liger" if args.tiny and name == PROVIDERS[2] else None
        if reason is None and name == PROVIDERS[2]:
            reason = liger_unavailable()
        if reason is not None:
            rows.append({"provider": name, "skipped": reason})
            continue
        try:
            rows.append(run_provider(name, args, shape, device))
        except torch.OutOfMemoryError as err:
            rows.append({"provider": name, "skipped": f"out of memory: {str(err).splitlines()[0]}"})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_results(out, environment, rows)  # after each provider: a crash keeps what was measured
    write_results(out, environment, rows)


if __name__ == "__main__":
    main()
