"""Evaluation: each eval dataset with its own sampling params, reporting mean reward and pass@k.

A response counts as correct when its reward is > 0 (1/0 graders and ±1 graders alike). pass@k uses the
unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
``pass@k = 1 - C(n - c, k) / C(n, k)``, averaged over prompts, for k = 1, 2, 4, ... <= n.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from math import comb

from redline.rollout.data import PromptDataset
from redline.rollout.generate import generate_sample
from redline.rollout.rewards import Reward
from redline.rollout.types import Sample, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalSet:
    name: str
    dataset: PromptDataset
    params: SamplingParams
    n_samples_per_prompt: int = 1
    reward: Reward | None = None  # None: the training reward


async def evaluate(engine, tokenizer, eval_set: EvalSet, reward: Reward, generate_fn=generate_sample,
                   shard: tuple[int, int] = (0, 1)) -> dict[str, float]:
    """Metrics ``eval/<name>/reward_mean`` and ``eval/<name>/pass@k`` over every prompt of the set, or with
    ``shard=(rank, world)`` over prompts ``rank, rank + world, ...`` only (0 for an empty shard): weighted by
    their prompt counts, the shards' metrics average to the whole set's."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"evaluate: shard=(rank, world) needs 0 <= rank < world, got {shard}")
    reward = eval_set.reward or reward
    n = eval_set.n_samples_per_prompt

    async def run_prompt(number: int, prompt: Sample) -> list[float]:
        # index: a stable id per (prompt, draw), so a seeding generate_fn draws the same way at every evaluation
        group = [Sample(prompt=prompt.prompt, tokens=list(prompt.tokens), label=prompt.label,
                        metadata=dict(prompt.metadata), index=number * n + j) for j in range(n)]
        group = await asyncio.gather(*(generate_fn(engine, tokenizer, s, eval_set.params) for s in group))
        return await reward(list(group))

    prompts = list(enumerate(eval_set.dataset.samples))[rank::world]
    rewards = await asyncio.gather(*(run_prompt(i, p) for i, p in prompts))
    flat = [r for group in rewards for r in group]
    metrics = {f"eval/{eval_set.name}/reward_mean": sum(flat) / max(len(flat), 1)}
    k = 1
    while k <= n:
        scores = [pass_at_k(n, sum(r > 0 for r in group), k) for group in rewards]
        metrics[f"eval/{eval_set.name}/pass@{k}"] = sum(scores) / max(len(scores), 1)
        k *= 2
    return metrics
