"""Rewards: turn finished samples into scalar rewards.

Built-ins (``--rm-type``): ``math`` (final answer vs label, sympy equivalence with a timeout), ``exact_match``,
``f1``, ``remote_rm`` (HTTP reward model at ``rm_url``). A user function (``--custom-rm-path module:function``)
takes precedence; it must be ``async`` and is either per sample ``async def rm(sample) -> float`` or, with
``group_rm=True``, per group ``async def rm(samples) -> list[float]`` (one reward per sample, same order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from redline.rollout.functions import load_function
from redline.rollout.rewards.math_answer import MathGrader
from redline.rollout.rewards.remote import RemoteRewardModel
from redline.rollout.rewards.text import exact_match, f1_score
from redline.rollout.types import Sample

BUILTIN_REWARDS = ("math", "exact_match", "f1", "remote_rm")


class Reward:
    """Scores a group of samples; owns the resources (worker process, HTTP session) the reward needs."""

    def __init__(self, score_group: Callable[[list[Sample]], Awaitable[list[float]]],
                 close: Callable[[], Awaitable[None]] | None = None):
        self._score_group = score_group
        self._close = close

    async def __call__(self, samples: list[Sample]) -> list[float]:
        rewards = await self._score_group(samples)
        if len(rewards) != len(samples):
            raise ValueError(f"reward function returned {len(rewards)} rewards for {len(samples)} samples")
        return [float(r) for r in rewards]

    async def close(self) -> None:
        if self._close is not None:
            await self._close()


def _per_sample(score: Callable[[Sample], Awaitable[float]]):
    async def score_group(samples: list[Sample]) -> list[float]:
        return list(await asyncio.gather(*(score(s) for s in samples)))
    return score_group


def build_reward(rm_type: str | None = None, *, custom_rm_path: str | None = None, group_rm: bool = False,
                 rm_url: str | None = None, math_timeout: float = 5.0) -> Reward:
    """The reward the config asks for; raises naming the flag when it is missing or unknown."""
    if custom_rm_path:
        fn = load_function(custom_rm_path, what="--custom-rm-path", must_be_async=True)
        return Reward(fn if group_rm else _per_sample(fn))
    if rm_type == "math":
        grader = MathGrader(timeout=math_timeout)

        async def close_grader():
            grader.close()
        return Reward(_per_sample(lambda s: grader.score(s.response, s.label)), close_grader)
    if rm_type == "exact_match":
        return Reward(_per_sample(_sync(lambda s: exact_match(s.response, s.label))))
    if rm_type == "f1":
        return Reward(_per_sample(_sync(lambda s: f1_score(s.response, s.label))))
    if rm_type == "remote_rm":
        if not rm_url:
            raise ValueError("--rm-type remote_rm needs --rm-url")
        model = RemoteRewardModel(rm_url)
        return Reward(_per_sample(lambda s: model.score(s.prompt, s.response, s.label)), model.close)
    if rm_type is None:
        raise ValueError("no reward configured: set --rm-type or --custom-rm-path")
    raise ValueError(f"--rm-type '{rm_type}' is unknown; built-ins are {', '.join(BUILTIN_REWARDS)}")


def _sync(fn: Callable[[Sample], float]) -> Callable[[Sample], Awaitable[float]]:
    """Cheap pure-Python scorers as coroutines, so every reward has the same async shape."""
    async def score(sample: Sample) -> float:
        return fn(sample)
    return score
