"""Dynamic sampling filters: ``def keep(samples: list[Sample]) -> bool`` on each finished, rewarded group
(``--dynamic-sampling-filter-path module:function``). Dropped groups are replaced by over-sampled ones."""

from __future__ import annotations

from redline.rollout.types import Sample


def reward_std_nonzero(samples: list[Sample]) -> bool:
    """Keep a group only when its rewards differ: a group whose rewards all agree has zero group-normalised
    advantage (GRPO), so it would cost a training step and teach nothing (DAPO's dynamic sampling)."""
    return len({s.reward for s in samples}) > 1
