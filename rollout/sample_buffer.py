"""Finished groups waiting for the trainer, and the policy versions their tokens came from.

A policy version counts the rollout steps the weights have trained: the loop pushes version ``rollout_id + 1``
after step ``rollout_id``, and step ``k`` trains weights of version ``k`` (the first weights are version 0). A
sample's staleness, trained at step ``k``: ``k`` minus the version of its oldest token. ``--max-staleness N``
keeps it at most N: a group holding an older token is dropped (its prompts are generated again) instead of
trained.
"""

from __future__ import annotations

from redline.rollout.types import Sample, Status


def policy_version(version: str) -> int:
    """The integer policy version of an engine's ``weight_version`` string."""
    try:
        return int(version)
    except ValueError:
        raise ValueError(f"weight version {version!r} is not a policy version (an integer): async rollout counts "
                         f"staleness in the loop's versions, which the engines report") from None


def oldest_version(sample: Sample) -> int | None:
    """Policy version of the sample's oldest generated token; None when it holds none yet."""
    versions = [v for v in sample.response_versions if v is not None] or sample.weight_versions
    return min(map(policy_version, versions)) if versions else None


def group_oldest(group: list[Sample]) -> int | None:
    found = [v for v in map(oldest_version, group) if v is not None]
    return min(found) if found else None


def staleness(sample: Sample, trained_by: int) -> int:
    """Policy versions between the sample's oldest token and the weights ``trained_by`` that train it (0 for a
    sample without generated tokens)."""
    oldest = oldest_version(sample)
    return 0 if oldest is None else trained_by - oldest


def too_stale(group: list[Sample], trained_by: int, max_staleness: int | None) -> bool:
    oldest = group_oldest(group)
    return max_staleness is not None and oldest is not None and trained_by - oldest > max_staleness


def restart(group: list[Sample]) -> None:
    """Back to the prompt: the response, its log-probs, versions and reward are dropped (a stale group is
    generated again from scratch)."""
    for sample in group:
        del sample.tokens[sample.prompt_length:]
        sample.response, sample.response_length, sample.reward = "", 0, None
        sample.loss_mask, sample.rollout_logp = [], []
        sample.weight_versions, sample.response_versions = [], []
        sample.status = Status.PENDING


class SampleBuffer:
    """Finished, scored groups in the order they finished; the trainer takes the oldest first."""

    def __init__(self):
        self.groups: list[list[Sample]] = []

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def num_samples(self) -> int:
        return sum(len(g) for g in self.groups)

    def put(self, group: list[Sample]) -> None:
        self.groups.append(group)

    def take(self, count: int, trained_by: int,
             max_staleness: int | None) -> tuple[list[list[Sample]], list[list[Sample]]]:
        """``(taken, stale)``: up to ``count`` groups within ``max_staleness`` of ``trained_by``, oldest first,
        and every group beyond the bound (both leave the buffer; the caller regenerates the stale ones)."""
        stale = [g for g in self.groups if too_stale(g, trained_by, max_staleness)]
        fresh = [g for g in self.groups if not too_stale(g, trained_by, max_staleness)]
        taken, self.groups = fresh[:count], fresh[count:]
        return taken, stale
