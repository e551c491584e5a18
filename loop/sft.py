"""Supervised fine-tuning on labelled prompts (``--sft-steps`` warm-up before RL, or ``--loss-type sft``)."""

import torch

from redline.loop.batching import aggregation_weight, pack, split_by_token_budget
from redline.rollout.types import Sample


def labelled_sample(prompt: Sample, tokenizer) -> Sample:
    """``prompt`` followed by its label's tokens and EOS as a fully trainable response."""
    if prompt.label is None:
        raise ValueError(f"SFT needs labels; prompt {prompt.prompt!r} has none (--label-key)")
    ids = list(tokenizer.encode(str(prompt.label), add_special_tokens=False)) + [tokenizer.eos_token_id]
    sample = Sample(prompt=prompt.prompt, tokens=list(prompt.tokens), label=prompt.label)
    sample.append_response(ids, [0.0] * len(ids), trainable=True)
    return sample


def sft_warmup(state, tokenizer) -> dict[str, float]:
    """Run ``--sft-steps`` optimizer steps of SFT, sync the engine, evaluate; returns ``sft/*`` and ``eval/*``."""
    cfg = state.config
    worker = state.worker
    worker.begin_sft(cfg.train.sft_lr or cfg.train.lr, cfg.train.sft_steps)
    losses = []
    for _ in range(cfg.train.sft_steps):
        prompts = [group[0] for group in state.rollout.sft_data.get_groups(cfg.train.global_batch_size, 1)]
        samples = [labelled_sample(p, tokenizer) for p in prompts]
        lengths = [len(s.tokens) for s in samples]
        batches = [pack(samples, ids, {}) for ids in split_by_token_budget(lengths, cfg.train.max_tokens_per_gpu)]
        units = [aggregation_weight(b, "token-mean") for b in batches]
        result = worker.step(batches, [u / sum(units) for u in units], worker.sft_loss)
        losses.append(result["sft_loss"])
    worker.end_sft()
    state.loop.run_until_complete(state.engine.update_weights([list(worker.model.export_hf())], version="sft"))
    metrics = {"sft/loss": losses[-1] if losses else float("nan"), "sft/steps": float(len(losses))}
    if state.rollout.has_eval:
        metrics.update(state.loop.run_until_complete(state.rollout.evaluate(-1)))
    return metrics
