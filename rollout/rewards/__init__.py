"""Rewards: turn finished samples into scalar rewards.

Built-ins (``--rm-type``): ``math`` (final answer vs label, sympy equivalence with a timeout), ``exact_match``,
``f1``, ``remote_rm`` (HTTP reward model at ``rm_url``). A user function (``--custom-rm-path module:function``)
takes precedence; it must be ``async`` and is either per sample ``async def rm(sample) -> float`` or, with
``group_rm=True``, per group ``async def rm(samples) -> list[float]`` (one reward per sample, same order).

A reward that fails — raises, runs past ``timeout`` seconds (``--rm-timeout``; a custom reward per call, the
remote RM per request, ``--rm-max-retries`` times), returns NaN/inf or the wrong number of rewards — raises
``RewardError`` naming the reward and the sample (``on_error="fail"``, the default), or scores that sample 0
and counts it in ``Reward.errors`` (``on_error="zero"``, ``--reward-error zero``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from redline.extras import MissingExtraError
from redline.rollout.functions import load_function
from redline.rollout.rewards.math_answer import MathGrader
from redline.rollout.rewards.remote import RemoteRewardModel
from redline.rollout.rewards.text import exact_match, f1_score
from redline.rollout.types import Sample

BUILTIN_REWARDS = ("math", "exact_match", "f1", "remote_rm")


class RewardError(RuntimeError):
    """A reward function failed on a sample; the message names the reward (its flag) and the sample."""


def _describe(sample: Sample) -> str:
    prompt = sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt)
    return f"sample {sample.index} (prompt {prompt[:60]!r}, response {sample.response[:60]!r})"


class Reward:
    """Scores a group of samples; owns the resources (worker process, HTTP session) the reward needs.

    ``score_one`` (per sample) or ``score_group`` (per group): exactly one. ``name``: how errors name the reward
    (its flag). ``timeout``: seconds per call, None for none (the built-ins bound their own work)."""

    def __init__(self, score_group: Callable[[list[Sample]], Awaitable[list[float]]] | None = None,
                 close: Callable[[], Awaitable[None]] | None = None, *,
                 score_one: Callable[[Sample], Awaitable[float]] | None = None, name: str = "reward",
                 timeout: float | None = None, on_error: str = "fail"):
        if (score_one is None) == (score_group is None):
            raise TypeError("Reward needs exactly one of score_one and score_group")
        if on_error not in ("fail", "zero"):
            raise ValueError(f"--reward-error must be 'fail' or 'zero', got {on_error!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"--rm-timeout must be > 0, got {timeout}")
        self._score_one, self._score_group, self._close = score_one, score_group, close
        self.name, self.timeout, self.on_error = name, timeout, on_error
        self.errors = 0  # samples scored 0 because their reward failed (on_error="zero")

    async def __call__(self, samples: list[Sample]) -> list[float]:
        if self._score_one is not None:
            scored = await asyncio.gather(*(self._guarded([s], self._score_one(s)) for s in samples))
            return [values[0] for values in scored]
        return await self._guarded(samples, self._score_group(samples))

    async def _guarded(self, samples: list[Sample], call: Awaitable) -> list[float]:
        """Await one reward call for ``samples`` (one sample, or a group) and check what it returned: one float per
        sample. A missing optional package (``MissingExtraError``) is not the sample's fault: it propagates as is."""
        where = _describe(samples[0]) if len(samples) == 1 else f"the group of {_describe(samples[0])}"
        try:
            result = await asyncio.wait_for(call, self.timeout)
        except TimeoutError:
            return self._failed(samples, f"took longer than --rm-timeout {self.timeout:g} s on {where}")
        except MissingExtraError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported with the sample
            return self._failed(samples, f"raised {type(exc).__name__}: {exc} on {where}")
        values = [result] if self._score_one is not None else result
        if not isinstance(values, (list, tuple)) or len(values) != len(samples):
            return self._failed(samples, f"returned {result!r} for {len(samples)} samples, {where}")
        checked = []
        for sample, value in zip(samples, values):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                checked += self._failed([sample], f"returned {value!r}, not a finite number, on {_describe(sample)}")
            else:
                checked.append(float(value))
        return checked

    def _failed(self, samples: list[Sample], what: str) -> list[float]:
        """Raise ``RewardError`` (``--reward-error fail``) or score each of ``samples`` 0 and count it."""
        if self.on_error == "fail":
            raise RewardError(f"reward {self.name} {what} (--reward-error zero scores such samples 0 instead)")
        self.errors += len(samples)
        return [0.0] * len(samples)

    async def close(self) -> None:
        if self._close is not None:
            await self._close()


def build_reward(rm_type: str | None = None, *, custom_rm_path: str | None = None, group_rm: bool = False,
                 rm_url: str | None = None, math_timeout: float = 5.0, timeout: float = 60.0,
                 max_retries: int = 3, on_error: str = "fail") -> Reward:
    """The reward the config asks for; raises naming the flag when it is missing or unknown. ``timeout`` and
    ``max_retries``: ``--rm-timeout`` (a custom reward's call, a remote RM's request) and ``--rm-max-retries``
    (the remote RM's retries of a failed request)."""
    policy = dict(on_error=on_error)
    if custom_rm_path:
        fn = load_function(custom_rm_path, what="--custom-rm-path", must_be_async=True)
        score = {"score_group": fn} if group_rm else {"score_one": fn}
        return Reward(**score, name=f"--custom-rm-path {custom_rm_path}", timeout=timeout, **policy)
    if rm_type == "math":
        grader = MathGrader(timeout=math_timeout)

        async def close_grader():
            grader.close()
        return Reward(score_one=lambda s: grader.score(s.response, s.label), close=close_grader,
                      name="--rm-type math", **policy)
    if rm_type == "exact_match":
        return Reward(score_one=_sync(lambda s: exact_match(s.response, s.label)), name="--rm-type exact_match",
                      **policy)
    if rm_type == "f1":
        return Reward(score_one=_sync(lambda s: f1_score(s.response, s.label)), name="--rm-type f1", **policy)
    if rm_type == "remote_rm":
        if not rm_url:
            raise ValueError("--rm-type remote_rm needs --rm-url")
        model = RemoteRewardModel(rm_url, timeout=timeout, retries=max_retries)
        return Reward(score_one=lambda s: model.score(s.prompt, s.response, s.label), close=model.close,
                      name=f"--rm-type remote_rm ({rm_url})", **policy)
    if rm_type is None:
        raise ValueError("no reward configured: set --rm-type or --custom-rm-path")
    raise ValueError(f"--rm-type '{rm_type}' is unknown; built-ins are {', '.join(BUILTIN_REWARDS)}")


def _sync(fn: Callable[[Sample], float]) -> Callable[[Sample], Awaitable[float]]:
    """Cheap pure-Python scorers as coroutines, so every reward has the same async shape."""
    async def score(sample: Sample) -> float:
        return fn(sample)
    return score
