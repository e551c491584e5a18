"""The fully asynchronous generation stream (``--async-rollout full``) and the engines' busy clock.

``RolloutStream`` keeps generating prompt groups from the rollout manager's data source, across rollout steps
and weight updates, with at most ``max_inflight`` trajectories in flight. A trajectory is in flight from its
group's first generate call until the trainer takes it: generating, or finished and waiting in the
``SampleBuffer``. Bounding both bounds the buffer, hence how stale a waiting sample can grow.

A weight update interrupts the requests in flight (documented choice): ``update_weights`` closes the gate to new
generate calls, pauses the engines (each running request comes back ABORTED with the tokens it has), runs the
push, resumes the engines and opens the gate. Each interrupted sample then continues from its partial response
with the new weights (a partial rollout); every token keeps the version that generated it
(``Sample.response_versions``). Letting the requests finish instead would hold the push, and the trainer, until
the longest response ends. A group whose oldest token is already more than ``max_staleness`` versions behind the
new weights can never be trained within the bound: it restarts from its prompt (counted in ``stale_dropped``).

Everything runs on the caller's event loop: the stream advances whenever the loop runs (the loop drives it while
the trainer trains in a worker thread).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from redline.rollout.manager import RolloutManager, unfinished
from redline.rollout.sample_buffer import SampleBuffer, restart, too_stale
from redline.rollout.types import Sample


class BusyClock:
    """The intervals in which the engines had work: ``enter`` / ``exit`` around each piece of generation
    (nested or concurrent pieces count once); ``busy(start, end)`` the seconds of ``[start, end]`` covered."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.active, self.since = 0, 0.0
        self.intervals: list[tuple[float, float]] = []

    def enter(self) -> None:
        if self.active == 0:
            self.since = self.now()
        self.active += 1

    def exit(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.intervals.append((self.since, self.now()))

    def busy(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` in which work was in flight; intervals that ended before ``start`` are
        forgotten (callers ask about successive windows)."""
        self.intervals = [(a, b) for a, b in self.intervals if b > start]
        spans = self.intervals + ([(self.since, end)] if self.active else [])
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


class RolloutStream:
    """``manager``: its data source, engine, reward, filter and generate function serve the stream (its own
    ``generate_rollout`` is not used). ``max_staleness``: None for no bound."""

    def __init__(self, manager: RolloutManager, *, max_inflight: int, max_staleness: int | None,
                 version: int = 0, busy: BusyClock | None = None):
        n = manager.n_samples_per_prompt
        if max_inflight < manager.rollout_batch_size * n:
            raise ValueError(f"max_inflight ({max_inflight}) must hold one rollout batch "
                             f"({manager.rollout_batch_size} groups x {n} samples)")
        self.manager, self.max_inflight, self.max_staleness = manager, max_inflight, max_staleness
        self.version = version  # of the weights the engines hold
        self.busy = busy or BusyClock()
        self.buffer = SampleBuffer()
        self.generating: dict[asyncio.Task, list[Sample]] = {}
        self.stale_dropped = 0  # samples dropped for staleness (finished or interrupted), since the last batch
        self.filtered = 0  # groups the dynamic filter dropped, since the last batch
        self.running = False
        self._gate: asyncio.Event | None = None  # open: generate calls may start
        self._changed: asyncio.Event | None = None
        self._limit: asyncio.Semaphore | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """Trajectories generating or waiting for the trainer."""
        return sum(len(g) for g in self.generating.values()) + self.buffer.num_samples

    def start(self) -> None:
        """Begin generating (on the running loop)."""
        self._gate, self._changed = asyncio.Event(), asyncio.Event()
        self._limit = asyncio.Semaphore(self.max_inflight)
        self._gate.set()
        self.running = True
        self._fill()

    def stop(self) -> None:
        """Start no new groups (the trainer needs no more batches); the ones in flight finish."""
        self.running = False

    def _fill(self) -> None:
        n = self.manager.n_samples_per_prompt
        while self.running and self.in_flight + n <= self.max_inflight:
            [group] = self.manager.data_source.get_groups(1, n)
            self._launch(group)

    def _launch(self, group: list[Sample]) -> None:
        task = asyncio.get_running_loop().create_task(self._generate(group))
        self.generating[task] = group
        task.add_done_callback(self._finished)

    async def _generate(self, group: list[Sample]) -> list[Sample]:
        """Generate the group to the end, continuing it after every interrupting weight update."""
        while True:
            await self._gate.wait()
            if too_stale(group, self.version, self.max_staleness):
                restart(group)
                self.stale_dropped += len(group)
            self.busy.enter()
            try:
                group = await self.manager.run_group(group, self._limit)
            finally:
                self.busy.exit()
            if not unfinished(group):
                return group

    def _finished(self, task: asyncio.Task) -> None:
        self.generating.pop(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = self._error or task.exception()
        else:
            group = task.result()
            if self.manager.dynamic_filter is None or self.manager.dynamic_filter(group):
                self.buffer.put(group)
            else:
                self.filtered += 1
            self._fill()
        self._changed.set()

    async def next_batch(self, trained_by: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``rollout_batch_size`` finished groups none of whose tokens is more than ``max_staleness`` versions
        older than ``trained_by`` (in draw order), and the stream's counts since the last batch."""
        count = self.manager.rollout_batch_size
        taken: list[list[Sample]] = []
        while True:
            if self._error is not None:
                raise self._error
            groups, stale = self.buffer.take(count - len(taken), trained_by, self.max_staleness)
            taken += groups
            for group in stale:  # regenerated from the prompt, in the place the buffer gave back
                restart(group)
                self.stale_dropped += len(group)
                self._launch(group)
            self._fill()
            if len(taken) == count:
                break
            self._changed.clear()
            await self._changed.wait()
        metrics = {"rollout/stale_dropped": float(self.stale_dropped), "rollout/dropped_groups": float(self.filtered),
                   "rollout/in_flight": float(self.in_flight)}
        self.stale_dropped = self.filtered = 0
        return sorted(taken, key=lambda g: g[0].group_index), metrics

    async def update_weights(self, version: int, push: Callable[[], Awaitable[None]]) -> None:
        """Interrupt the requests in flight, ``push()`` the weights of ``version``, and let generation go on."""
        engine = self.manager.engine
        self._gate.clear()
        await engine.pause()
        try:
            await push()
            self.version = version
        finally:
            await engine.resume()
            self._gate.set()

    def untrained(self) -> list[list[Sample]]:
        """Every group generated (wholly or in part) and not yet trained: the buffer's, then those generating as
        they stand (a running request's tokens are not in its sample until it returns)."""
        return list(self.buffer.groups) + list(self.generating.values())
