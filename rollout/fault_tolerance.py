"""Engines behind health checks: a dead or hung engine is found, replaced and caught up; no request is lost.

``FaultTolerantEngine`` implements ``redline.rollout.engine.Engine`` over ``count`` engines made by ``start()``,
engines in processes of their own (``EmbeddedEngineProcess``): their ``kill()`` ends the process without asking it
and fails every call still waiting for an answer. Each ``generate`` call goes to the next healthy engine in turn.
A health monitor, a task on the run's event loop (it checks while the loop runs:
rollouts, evaluations, weight pushes), asks every engine ``health()`` each ``interval`` seconds, from
``first_wait`` seconds after the engine started. An engine that answers False, raises or stays silent for
``timeout`` seconds is killed and replaced:

1. every ``generate`` call in flight on it is sent again to a healthy engine (``retried_requests`` counts its
   requests). A request carries its own sampling seed, so the retry draws what the dead engine would have drawn;
   the dead engine's answer is never used, so each request returns exactly once: nothing lost, nothing twice;
2. ``start()`` makes a new engine and ``restore(engine)`` (set by the weight sync) gives it the current weights
   before any request reaches it (``restarts``).

While no engine is healthy, calls wait for the replacement. ``replace_dead()`` checks at once (before a weight
push: an engine may have died while the trainer trained and the loop was not running); an engine that can tell
without a request whether its process runs (``running()``) and answered within the interval is not asked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redline.rollout.engine_fan_out import EngineFanOut


@dataclass
class _Slot:
    engine: object
    started: float = field(default_factory=time.monotonic)
    answered: float = field(default_factory=time.monotonic)  # its last answer (a result or a passed health check)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set while the engine may take requests
    died: asyncio.Event = field(default_factory=asyncio.Event)  # this incarnation's end (a new one per restart)


class FaultTolerantEngine(EngineFanOut):
    def __init__(self, start: Callable[[], object], *, count: int = 1, first=None, interval: float = 30.0,
                 timeout: float = 30.0, first_wait: float = 0.0):
        """``first``: an engine ``start()`` already made (it becomes engine 0)."""
        if interval <= 0 or timeout <= 0 or first_wait < 0:
            raise ValueError(f"health checks need interval > 0, timeout > 0, first_wait >= 0; got {interval}, "
                             f"{timeout}, {first_wait}")
        self._start = start
        self.interval, self.timeout, self.first_wait = interval, timeout, first_wait
        self._slots = [_Slot(first if i == 0 and first is not None else start()) for i in range(count)]
        for slot in self._slots:
            slot.ready.set()
        self.restore: Callable[[object], Awaitable[None]] | None = None
        self.restarts = 0
        self.retried_requests = 0
        self._next = 0
        self._monitor: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._kill_armed: int | None = None
        self._reported = (0, 0)

    @property
    def engines(self) -> list:
        return [slot.engine for slot in self._slots]

    async def generate(self, requests):
        # the engine's call awaited as it is, nothing beside it: a rollout makes one call per sample, and a task
        # per call plus one waiting for the engine's death cost 3 to 4 times the engine calls' own event-loop time
        # (benchmarks/results/loop/ray-cpu/README.md). A dead engine's calls end through ``kill()``.
        self._watch()
        while True:
            slot = await self._healthy_slot()
            died = slot.died
            try:
                result = await slot.engine.generate(requests)
            except Exception:
                if not died.is_set():
                    if await self._answers(slot):
                        raise  # the engine is fine: the error is the request's own
                    await self._replace(slot)
            else:
                if not died.is_set():
                    slot.answered = time.monotonic()
                    self._after_result(slot)
                    return result
                # else an answer of an engine already declared dead: dropped, the retry answers the request once
            self.retried_requests += len(requests)

    def kill_after_first_result(self, index: int) -> None:
        """Fault injection (``redline.loop.faults``): SIGKILL engine ``index``'s process when its next answer
        comes back, while its other requests are still in flight."""
        self._kill_armed = index

    def take_metrics(self) -> dict[str, float]:
        """``rollout/engine_restarts`` and ``rollout/retried_requests`` since the last call."""
        restarts, retried = self._reported
        self._reported = (self.restarts, self.retried_requests)
        return {"rollout/engine_restarts": float(self.restarts - restarts),
                "rollout/retried_requests": float(self.retried_requests - retried)}

    async def replace_dead(self) -> None:
        """Check every engine now and replace the ones that do not answer. An engine that answered within the
        health-check interval and whose process still runs (``running()``, a look at the process: no request) is
        not asked again: a round trip through its request queue before every weight push was a measurable part
        of the push (benchmarks/results/loop/ray-cpu/README.md)."""
        for slot in self._slots:
            if not slot.ready.is_set() or self._answered_lately(slot):
                continue
            if not await self._answers(slot):
                await self._replace(slot)
        self._raise_failure()

    def _answered_lately(self, slot: _Slot) -> bool:
        running = getattr(slot.engine, "running", None)
        return running is not None and running() and time.monotonic() - slot.answered < self.interval

    def _after_result(self, slot: _Slot) -> None:
        if self._kill_armed is not None and self._slots[self._kill_armed] is slot:
            self._kill_armed = None
            os.kill(slot.engine.pid, signal.SIGKILL)

    async def _healthy_slot(self) -> _Slot:
        while True:
            self._raise_failure()
            for offset in range(len(self._slots)):
                slot = self._slots[(self._next + offset) % len(self._slots)]
                if slot.ready.is_set():
                    self._next += offset + 1
                    return slot
            waits = [asyncio.ensure_future(s.ready.wait()) for s in self._slots]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    def _watch(self) -> None:
        """Start the health monitor on the running loop (once)."""
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.ensure_future(self._check_forever())

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for slot in self._slots:
                due = time.monotonic() - slot.started >= self.first_wait
                if due and slot.ready.is_set() and not await self._answers(slot):
                    try:
                        await self._replace(slot)
                    except Exception:  # noqa: BLE001 - kept in _failure: every caller waiting for an engine raises it
                        return

    async def _answers(self, slot: _Slot) -> bool:
        try:
            healthy = bool(await asyncio.wait_for(slot.engine.health(), self.timeout))
        except Exception:  # noqa: BLE001 - a health check that fails in any way is an unhealthy engine
            return False
        if healthy:
            slot.answered = time.monotonic()
        return healthy

    async def _replace(self, slot: _Slot) -> None:
        if not slot.ready.is_set():
            return  # being replaced already
        slot.ready.clear()
        slot.died.set()
        slot.engine.kill()
        try:
            # in the loop's thread, which lives as long as the run: an engine process ends with the thread that
            # started it (redline.rollout.embedded.lifeline)
            engine = self._start()
            if self.restore is not None:
                await self.restore(engine)
        except BaseException as exc:
            self._failure = exc
            slot.ready.set()  # wakes the callers waiting for an engine; they raise the failure
            raise
        slot.engine, slot.started, slot.died = engine, time.monotonic(), asyncio.Event()
        self.restarts += 1
        slot.ready.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"a rollout engine could not be restarted: {self._failure!r}") from self._failure

    async def health(self) -> bool:
        return all(await asyncio.gather(*(self._answers(s) for s in self._slots)))

    async def shutdown(self):
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await super().shutdown()

    def _engines(self) -> list:
        return [slot.engine for slot in self._slots]
