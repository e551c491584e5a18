"""RolloutManager: prompts in, scored groups of ``Sample``s out, using any ``Engine``.

One rollout step (``generate_rollout``):
  1. draw ``over_sampling_batch_size`` prompt groups (``n_samples_per_prompt`` copies each) from the data
     source and generate all their samples concurrently (at most ``max_inflight`` generate calls at once);
  2. score each finished group with the reward, then keep it if the dynamic filter says so;
  3. while kept + in-flight groups fall short of ``rollout_batch_size``, draw more groups;
  4. once ``rollout_batch_size`` groups are kept, pause the engine (aborting what still runs), and with
     ``partial_rollout`` return the unfinished groups, partial responses included, to the data source.
The methods are narrow and take/return plain data so the class can be wrapped as a Ray actor unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redline.rollout.data import DataSource
from redline.rollout.generate import generate_sample
from redline.rollout.rewards import Reward
from redline.rollout.types import Sample, SamplingParams, Status

MAX_INFLIGHT = 1024  # generate calls a manager keeps running at once, by default


@dataclass
class RolloutOutput:
    groups: list[list[Sample]]  # rollout_batch_size groups of n_samples_per_prompt finished, rewarded samples
    metrics: dict[str, float] = field(default_factory=dict)


def unfinished(group: list[Sample]) -> bool:
    return any(s.status in (Status.PENDING, Status.ABORTED) for s in group)


class RolloutManager:
    def __init__(self, engine, tokenizer, data_source: DataSource, reward: Reward, *, params: SamplingParams,
                 rollout_batch_size: int, n_samples_per_prompt: int, over_sampling_batch_size: int | None = None,
                 dynamic_filter: Callable[[list[Sample]], bool] | None = None, partial_rollout: bool = False,
                 generate_fn=generate_sample, max_inflight: int = MAX_INFLIGHT):
        over = over_sampling_batch_size or rollout_batch_size
        if rollout_batch_size < 1 or n_samples_per_prompt < 1 or max_inflight < 1:
            raise ValueError(f"need rollout_batch_size, n_samples_per_prompt, max_inflight >= 1, got "
                             f"{rollout_batch_size}, {n_samples_per_prompt}, {max_inflight}")
        if over < rollout_batch_size:
            raise ValueError(f"over_sampling_batch_size ({over}) must be >= rollout_batch_size ({rollout_batch_size})")
        self.engine, self.tokenizer, self.data_source, self.reward = engine, tokenizer, data_source, reward
        self.params = params
        self.rollout_batch_size, self.n_samples_per_prompt = rollout_batch_size, n_samples_per_prompt
        self.over_sampling_batch_size = over
        self.dynamic_filter = dynamic_filter
        self.partial_rollout = partial_rollout
        self.generate_fn = generate_fn
        self.max_inflight = max_inflight

    async def run_group(self, group: list[Sample], limit: asyncio.Semaphore) -> list[Sample]:
        """Generate every unfinished sample of the group, then score the group unless an abort cut it short."""
        async def one(sample: Sample) -> Sample:
            if sample.status in (Status.COMPLETED, Status.TRUNCATED):
                return sample  # finished before an abort; a partial rollout only continues the rest
            async with limit:
                return await self.generate_fn(self.engine, self.tokenizer, sample, self.params)
        group = list(await asyncio.gather(*(one(s) for s in group)))
        if not unfinished(group):
            for sample, reward in zip(group, await self.reward(group)):
                sample.reward = reward
        return group

    async def generate_rollout(self) -> RolloutOutput:
        start = time.perf_counter()
        reward_errors = self.reward.errors
        limit = asyncio.Semaphore(self.max_inflight)
        kept: list[list[Sample]] = []
        dropped = 0
        in_flight: set[asyncio.Task] = set()
        try:
            kept, dropped, leftover = await self._collect(in_flight, limit)
        except BaseException:
            # a failed reward or generate: stop the other groups now, so no task outlives the step
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            raise
        metrics = self.batch_metrics(kept, dropped, len(leftover), time.perf_counter() - start)
        metrics["rollout/reward_errors"] = float(self.reward.errors - reward_errors)
        return RolloutOutput(kept, metrics)

    async def _collect(self, in_flight: set[asyncio.Task], limit: asyncio.Semaphore):
        """(kept groups, dropped count, leftover groups) of one rollout step; ``in_flight`` holds the running
        groups' tasks (the caller cancels them on failure)."""
        kept: list[list[Sample]] = []
        dropped = 0
        leftover_early: list[list[Sample]] = []
        while len(kept) < self.rollout_batch_size:
            if len(kept) + len(in_flight) < self.rollout_batch_size:
                for group in self.data_source.get_groups(self.over_sampling_batch_size, self.n_samples_per_prompt):
                    in_flight.add(asyncio.create_task(self.run_group(group, limit)))
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                in_flight.discard(task)  # one at a time: on a failure the rest stay for the caller to collect
                group = task.result()
                if unfinished(group):  # aborted by someone else's pause; never trained on half a group
                    leftover_early.append(group)
                elif self.dynamic_filter is None or self.dynamic_filter(group):
                    kept.append(group)
                else:
                    dropped += 1
        leftover = leftover_early + kept[self.rollout_batch_size:]
        # in draw order, not completion order (thread timing): the same seed trains on the same batches
        kept = sorted(kept[:self.rollout_batch_size], key=lambda group: group[0].group_index)
        if in_flight:
            await self.engine.pause()
            leftover += list(await asyncio.gather(*in_flight))
            in_flight.clear()
            await self.engine.resume()
        if self.partial_rollout:
            self.data_source.add_groups(leftover)
        return kept, dropped, leftover

    def batch_metrics(self, groups, dropped, leftover, seconds) -> dict[str, float]:
        samples = [s for g in groups for s in g]
        lengths = [s.response_length for s in samples]
        return {
            "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
            "rollout/response_len_mean": sum(lengths) / len(samples),
            "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
            "rollout/dropped_groups": float(dropped),
            "rollout/returned_groups" if self.partial_rollout else "rollout/discarded_groups": float(leftover),
            "perf/rollout_time": seconds,
            "perf/rollout_tokens_per_sec": sum(lengths) / seconds,
        }

    @property
    def skipped_records(self) -> int:
        """Malformed records of the prompt file that ``skip_bad_records`` skipped."""
        return self.data_source.dataset.stats.skipped_bad

    async def close(self) -> None:
        """Release what the reward holds (a grader process, an HTTP session)."""
        await self.reward.close()

    def state_dict(self) -> dict:
        return {"data_source": self.data_source.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.data_source.load_state_dict(state["data_source"])
