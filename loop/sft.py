"""Supervised fine-tuning on labelled prompts: the ``--sft-steps`` warm-up before RL, or ``--loss-type sft``."""

from redline.loop.batching import aggregation_weight, pack, split_by_token_budget
from redline.loop.dealt_rollout import evaluation
from redline.loop.train_offload import ensure_resident
from redline.rollout.types import Sample


def labelled_sample(prompt: Sample, tokenizer) -> Sample:
    """``prompt`` followed by its label's tokens and EOS as a fully trainable response."""
    if prompt.label is None:
        raise ValueError(f"SFT needs labels; prompt {prompt.prompt!r} has none (--label-key)")
    ids = list(tokenizer.encode(str(prompt.label), add_special_tokens=False)) + [tokenizer.eos_token_id]
    sample = Sample(prompt=prompt.prompt, tokens=list(prompt.tokens), label=prompt.label)
    sample.append_response(ids, [0.0] * len(ids), trainable=True)
    return sample


def sft_step(state, tokenizer) -> dict[str, float]:
    """One optimizer step of token-mean NLL on ``--global-batch-size`` labelled prompts of the SFT data (this
    rank's share of them, with data parallelism)."""
    cfg, dp = state.config, state.dp
    prompts = [group[0] for group in state.rollout.sft_data.get_groups(cfg.train.global_batch_size // dp.world, 1)]
    samples = [labelled_sample(p, tokenizer) for p in prompts]
    lengths = [len(s.tokens) for s in samples]
    batches = [pack(samples, ids, {}) for ids in split_by_token_budget(lengths, cfg.train.max_tokens_per_gpu)]
    weights = dp.loss_weights([aggregation_weight(b, "token-mean") for b in batches])
    return state.worker.step(batches, weights, state.worker.sft_loss)


def sft_warmup(state, tokenizer) -> dict[str, float]:
    """Run ``--sft-steps`` steps with their own optimiser, sync the engine, evaluate; returns ``sft/*``, ``eval/*``."""
    cfg = state.config
    ensure_resident(state)  # --offload-train: paused since the engine started
    state.worker.begin_sft(cfg.train.sft_lr or cfg.train.lr, cfg.train.sft_steps)
    results = [sft_step(state, tokenizer) for _ in range(cfg.train.sft_steps)]
    state.worker.end_sft()
    state.loop.run_until_complete(state.weight_sync.push("0"))  # policy version 0: the weights step 0 trains
    metrics = {"sft/loss": results[-1]["sft_loss"] if results else float("nan"), "sft/steps": float(len(results))}
    if state.rollout.has_eval:
        metrics.update(evaluation(state, -1))
    return metrics


def sft_rollout(state, tokenizer, rollout_id: int) -> dict[str, float]:
    """``--loss-type sft``: ``--num-steps-per-rollout`` SFT steps, then sync the engine (for eval)."""
    ensure_resident(state)  # --offload-train: paused at the last push (or since the engine started)
    results = [sft_step(state, tokenizer) for _ in range(state.config.train.num_steps_per_rollout)]
    state.loop.run_until_complete(state.weight_sync.push(str(rollout_id + 1)))
    return {"train/sft_loss": results[-1]["sft_loss"], "train/grad_norm": results[-1]["grad_norm"],
            "train/lr": results[-1]["lr"], "train/skipped_steps": sum(r["skipped"] for r in results)}
