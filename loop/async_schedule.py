"""How the RL step's pieces are scheduled (``--async-rollout``): in series, one step off, or fully async.

The step (``redline.loop.step.rl_step``) is the same in every schedule: it asks ``state.rollout.generate`` for
its batch, trains on it between ``overlap_begin()`` and ``overlap_end()``, then calls
``state.weight_sync.push``. An async schedule puts wrappers in place of ``state.rollout`` and
``state.weight_sync`` that give those calls its meaning, and runs the event loop in a helper thread while the
trainer trains in this one, so the engines keep generating in processes of their own: ``--no-colocate`` (embedded
engine processes, or SGLang servers launched or attached, whose HTTP requests the loop keeps running; weights by
the disaggregated broadcast), or on one GPU an embedded engine process beside the trainer
(``--embedded-engine-process``, weights by CUDA IPC). Beside a TP/PP trainer (``--no-colocate``, one model-parallel
group) the schedule generates and pauses the engines on rank 0, which takes the batch; a step's push is marked
where every rank passes (``overlap_begin``), so the group's ranks agree on which steps push. With data parallelism
(``--no-colocate``, ``one-step``) rank 0's schedule generates every rank's batch (``redline.loop.dealt_rollout``
deals it out) and the step's engine-side metrics are its clock's:

* ``off`` (``Synchronous``): generate → train → push, in series.
* ``one-step`` (``OneStepOff``, slime's ``train_async.py``): ``generate`` hands over rollout k, generated while
  step k-1 trained, and starts rollout k+1 at once; the push after step k (every ``--update-weights-interval``
  steps) first waits for that generation to end, so every sample is exactly one version stale (at most the
  interval).
* ``full`` (``FullyAsync``): a ``redline.rollout.stream.RolloutStream`` keeps up to ``--max-inflight``
  trajectories in flight across steps; a push interrupts the requests in flight, which continue with the new
  weights (per-token versions recorded); ``generate`` takes the oldest finished groups within
  ``--max-staleness`` of the trainer's version, dropping and regenerating older ones (``rollout/stale_dropped``).

Trained at step k (the trainer's weights are policy version k), a sample's staleness is k minus the version of
its oldest token (``redline.rollout.sample_buffer``). Per step, the async schedules report
``rollout/staleness_mean`` / ``_max``, ``perf/rollout_time`` (seconds of the step in which the engines were
generating), ``perf/overlap_ratio`` (share of the step in which the engines generated while the trainer
trained), ``perf/train_wait_time`` (the trainer waiting for a batch, or for the generation a push waits for) and
``perf/rollout_wait_time`` (the engines idle), and the train-rollout log-prob gap per staleness
(``train/rollout_logprob_abs_diff/staleness_<s>``).

Checkpoints: the rollout's ``state_dict`` puts every generated-and-untrained group (finished, or as far as its
last generate call got) at the front of the data source's buffer, so a resumed run trains them first, keeping
their versions; nothing generated is lost and every batch stays complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time

import torch
from redline.configfile import ConfigError
from redline.loop.dealt_rollout import deals_rollouts
from redline.rollout.manager import RolloutOutput
from redline.rollout.sample_buffer import oldest_version, staleness
from redline.rollout.stream import BusyClock, RolloutStream


def check_async(config, world_size: int = 1) -> None:
    """Start-up checks of ``--async-rollout``, ``--max-staleness``, ``--max-inflight``,
    ``--update-weights-interval`` and ``--tis``; each failure names the flags."""
    r, mode = config.rollout, config.rollout.async_rollout
    interval = config.sync.update_weights_interval
    if interval < 1:
        raise ConfigError(f"--update-weights-interval must be >= 1, got {interval}")
    if config.algo.tis == "none" and config.algo.use_tis:
        raise ConfigError("--tis none turns the off-policy correction off, but --use-tis asks for it: drop one")
    if mode == "off":
        for flag, value, default in [("--update-weights-interval", interval, 1), ("--max-staleness", r.max_staleness,
                                     None), ("--max-inflight", r.max_inflight, None)]:
            if value != default:
                raise ConfigError(f"{flag} applies to --async-rollout one-step or full; without it the step pushes "
                                  "after every rollout")
        return
    from redline.loop.rollout_setup import resolve_engine

    if config.parallel.colocate and resolve_engine(config) == "sglang":
        raise ConfigError(f"--async-rollout {mode} with --rollout-engine sglang needs --no-colocate (servers launched "
                          f"on GPUs of their own, or attached with --sglang-server-urls): a colocated SGLang server "
                          f"takes turns with the trainer on its GPU, so nothing would generate while it trains")
    if config.parallel.colocate and not (r.embedded_engine_process and r.rollout_engine == "embedded"):
        raise ConfigError(f"--async-rollout {mode} needs --no-colocate: the engines generate in processes (on GPUs) "
                          f"of their own while the trainer trains, and a colocated engine shares the trainer's "
                          f"process and GPU (on one GPU, --rollout-engine embedded --embedded-engine-process runs "
                          f"the engine as a second process beside the trainer)")
    if config.parallel.colocate and config.sync.offload_rollout:
        raise ConfigError(f"--async-rollout {mode} with --offload-rollout: the engine generates while the trainer "
                          f"trains, so it cannot give its memory back meanwhile; drop --offload-rollout")
    from redline.loop.train_offload import offload_train_enabled

    if offload_train_enabled(config):
        raise ConfigError(f"--async-rollout {mode} with --offload-train: the trainer trains while the engine "
                          f"generates, so its state cannot be paused meanwhile; drop --offload-train")
    p = config.parallel
    group = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world_size > group and p.colocate:  # TP/PP: check_model_parallel
        raise ConfigError(f"--async-rollout {mode} with data parallelism ({world_size} torchrun processes) needs "
                          f"--no-colocate: rank 0's engines then generate for every data-parallel rank")
    if world_size > group and mode == "full":
        # a stream's batch mixes staleness values, each DP rank's share its own mix: the ranks would disagree on the
        # old log-probs' pass and on the per-staleness metrics the step's reduction averages
        raise ConfigError(f"--async-rollout full with --no-colocate runs the trainer in one process or one TP × PP "
                          f"group, not {world_size} torchrun processes = {world_size // group} data-parallel ranks × "
                          f"--tensor-model-parallel-size {p.tensor_model_parallel_size} × "
                          f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size}: use --async-rollout "
                          f"one-step with data parallelism, or launch {group} processes")
    if config.algo.loss_type == "sft":
        raise ConfigError(f"--async-rollout {mode} schedules RL rollouts; --loss-type sft has none")
    if r.max_staleness is not None and r.max_staleness < 0:
        raise ConfigError(f"--max-staleness must be >= 0, got {r.max_staleness}")
    batch = r.rollout_batch_size * r.n_samples_per_prompt
    if mode == "one-step":
        if r.max_inflight is not None:
            raise ConfigError("--max-inflight applies to --async-rollout full (one-step generates one rollout ahead)")
        if r.max_staleness is not None and r.max_staleness < interval:
            raise ConfigError(f"--async-rollout one-step trains samples generated up to --update-weights-interval "
                              f"({interval}) versions earlier: --max-staleness {r.max_staleness} would drop every "
                              f"batch; raise it to >= {interval} or use --async-rollout full")
    if mode == "full":
        if r.max_inflight is not None and r.max_inflight < batch:
            raise ConfigError(f"--max-inflight ({r.max_inflight}) must hold one rollout batch: --rollout-batch-size "
                              f"x --n-samples-per-prompt = {batch}")
        if r.max_staleness is not None and r.max_staleness < interval - 1:
            raise ConfigError(f"--max-staleness {r.max_staleness} with --update-weights-interval {interval}: the "
                              f"engines' weights fall up to {interval - 1} versions behind the trainer's, so "
                              f"fresh samples could never be trained; raise --max-staleness to >= {interval - 1}")
        if r.over_sampling_batch_size not in (None, r.rollout_batch_size):
            raise ConfigError("--over-sampling-batch-size has no meaning in --async-rollout full: the stream "
                              "draws one group at a time up to --max-inflight")


def off_policy_correction(config) -> str | None:
    """The loss's correction against the engine's log-probs (``LossConfig.tis``): ``--tis`` when it names one
    (``none``: off); ``auto``: ``--tis-mode`` with ``--use-tis``, and also without it under ``--async-rollout``,
    whose samples come from older weights than the ones they train."""
    algo = config.algo
    if algo.tis != "auto":
        return None if algo.tis == "none" else algo.tis
    return algo.tis_mode if algo.use_tis or config.rollout.async_rollout != "off" else None


def make_schedule(state):
    """The schedule ``--async-rollout`` names, installed into ``state``."""
    mode = state.config.rollout.async_rollout
    return {"off": Synchronous, "one-step": OneStepOff, "full": FullyAsync}[mode](state)


class Synchronous:
    """Rollout, training and push in series: the step's calls mean what they say."""

    def __init__(self, state):
        self.state = state

    def overlap_begin(self) -> None:
        """The trainer starts training (nothing generates meanwhile)."""

    def overlap_end(self) -> None:
        """The trainer is done; idempotent (the run's shutdown calls it too)."""

    def mixed_staleness(self, samples) -> bool:
        return False

    def step_metrics(self, samples, *, step_start: float, step_time: float, batch_wait: float,
                     sync_time: float, old_logp, rollout_logp, overall_diff: float) -> dict[str, float]:
        return {}


class _Async(Synchronous):
    """What the async schedules share: the wrappers, the helper thread, the clocks and the metrics."""

    def __init__(self, state):
        super().__init__(state)
        self.loop = state.loop
        self.interval = state.config.sync.update_weights_interval
        self.num_rollout = state.config.rollout.num_rollout
        self.busy = BusyClock()
        self.rollout, self.weight_sync = state.rollout, state.weight_sync
        state.rollout, state.weight_sync = ScheduledRollout(self), ScheduledWeightSync(self)
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self.train_span = (0.0, 0.0)
        self.push_wait = 0.0
        # set where every rank of a model-parallel group passes, not only the leader that takes the batch: the
        # group's ranks must agree on which pushes happen (their gathers are collectives)
        self.in_step = False  # between a step's batch (overlap_begin) and its push
        self.current = 0  # the trainer's policy version at the step being run (its push's version - 1)

    # ----- the wrappers' meaning (subclasses) ------------------------------------------------------------

    async def batch(self, rollout_id: int) -> tuple[list, dict[str, float]]:
        raise NotImplementedError

    async def step_push(self, version: str) -> None:
        """The push that ends a step, when ``due``."""
        raise NotImplementedError

    async def push(self, version: str) -> None:
        """A step's push goes by the schedule; any other (a resume's, the SFT warm-up's) goes through at once."""
        in_step, self.in_step = self.in_step, False
        if not in_step:
            await self.weight_sync.push(version)
            return
        self.current = int(version) - 1
        if self.due(version):
            await self.step_push(version)
        else:
            self.weight_sync.timings = {}

    def untrained(self) -> list[list]:
        raise NotImplementedError

    async def settle(self) -> None:
        """Before an evaluation: nothing of the schedule may pause the engines while it runs."""

    def due(self, version: str) -> bool:
        return int(version) % self.interval == 0

    # ----- overlap: the loop runs in a helper thread while the trainer trains ------------------------------

    def overlap_begin(self) -> None:
        self.in_step = True
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._stop.wait(),),
                                        name="rollout-while-training", daemon=True)
        began = time.perf_counter()
        self._thread.start()
        self.train_span = (began, began)

    def overlap_end(self) -> None:
        if self._thread is None:
            return
        self.train_span = (self.train_span[0], time.perf_counter())
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()
        self._thread = None

    # ----- metrics ---------------------------------------------------------------------------------------

    def mixed_staleness(self, samples) -> bool:
        """Whether the batch holds samples of several staleness values: the loss's own forward then cannot give
        the log-prob gap per staleness, so the old log-probs get a forward of their own."""
        return len({oldest_version(s) for s in samples}) > 1

    def step_metrics(self, samples, *, step_start: float, step_time: float, batch_wait: float,
                     sync_time: float, old_logp, rollout_logp, overall_diff: float) -> dict[str, float]:
        step_end = step_start + step_time
        generating = self.busy.busy(step_start, step_end)
        metrics = {
            "perf/rollout_time": generating,
            "perf/overlap_ratio": self.busy.busy(*self.train_span) / step_time,
            "perf/train_wait_time": batch_wait + self.push_wait,
            "perf/rollout_wait_time": step_time - generating,
            "perf/update_weights_time": sync_time - self.push_wait,
        }
        self.push_wait = 0.0
        if deals_rollouts(self.state.config, self.state.dp):
            # the engines are rank 0's: its busy clock and its waits for them are the step's (the other ranks' clocks
            # saw no generation, and the step's DP reduction would average or take the slowest of them)
            metrics = self.state.dp.from_main(lambda: metrics)
        metrics.update(mismatch_by_staleness(samples, self.current, old_logp, rollout_logp, overall_diff))
        return metrics

    def staleness_metrics(self, samples, trained_by: int) -> dict[str, float]:
        values = [staleness(s, trained_by) for s in samples]
        return {"rollout/staleness_mean": sum(values) / len(values), "rollout/staleness_max": float(max(values))}


def mismatch_by_staleness(samples, trained_by: int, old_logp, rollout_logp, overall: float) -> dict[str, float]:
    """``train/rollout_logprob_abs_diff/staleness_<s>``: the mean |trainer − engine| log-prob gap over the loss
    tokens of the samples of each staleness ``s``. From the old log-probs when the step computed them, else (one
    staleness in the batch) the loss's own gap ``overall``."""
    by_staleness: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        by_staleness.setdefault(staleness(sample, trained_by), []).append(i)
    if old_logp is None:
        return {f"train/rollout_logprob_abs_diff/staleness_{s}": overall for s in by_staleness}
    metrics = {}
    for s, ids in sorted(by_staleness.items()):
        gaps = torch.cat([(old_logp[i] - rollout_logp[i]).abs() for i in ids])
        mask = torch.cat([torch.tensor(samples[i].loss_mask, dtype=torch.bool) for i in ids])
        metrics[f"train/rollout_logprob_abs_diff/staleness_{s}"] = float(gaps[mask].mean()) if mask.any() else 0.0
    return metrics


class OneStepOff(_Async):
    """Rollout k+1 generates while the trainer trains on rollout k."""

    def __init__(self, state):
        super().__init__(state)
        self.pending: asyncio.Task | None = None

    async def _generate(self, rollout_id: int):
        self.busy.enter()
        try:
            return await self.rollout.generate(rollout_id)
        finally:
            self.busy.exit()

    def _start(self, rollout_id: int) -> None:
        self.pending = asyncio.get_running_loop().create_task(self._generate(rollout_id))

    async def batch(self, rollout_id: int):
        if self.pending is None:  # the first step (or the first after a resume)
            self._start(rollout_id)
        samples, metrics = await self.pending
        self.pending = None
        if rollout_id + 1 < self.num_rollout:
            self._start(rollout_id + 1)
        metrics.update(self.staleness_metrics(samples, rollout_id))
        return samples, metrics

    async def step_push(self, version: str) -> None:
        began = time.perf_counter()
        await self.settle()  # slime: the weights change between rollouts, never inside one
        self.push_wait = time.perf_counter() - began
        await self.weight_sync.push(version)

    async def settle(self) -> None:
        if self.pending is not None:
            await asyncio.wait([self.pending])

    def untrained(self) -> list[list]:
        if self.pending is None:
            return []
        if not self.pending.done():
            self.loop.run_until_complete(self.settle())
        samples, _ = self.pending.result()
        return [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group_index)]


class FullyAsync(_Async):
    """A generation stream across steps and weight updates, batches within the staleness bound."""

    def __init__(self, state):
        super().__init__(state)
        r = state.config.rollout
        manager = self.rollout.manager
        self.stream = RolloutStream(manager, busy=self.busy, max_staleness=r.max_staleness,
                                    max_inflight=r.max_inflight or manager.rollout_batch_size * r.n_samples_per_prompt)
        self.started = False

    async def batch(self, rollout_id: int):
        if not self.started:
            self.started = True
            self.stream.version = rollout_id  # the engines hold the weights of the step about to train
            self.stream.start()
        began = time.perf_counter()
        groups, stream_metrics = await self.stream.next_batch(rollout_id)
        if rollout_id + 1 >= self.num_rollout:
            self.stream.stop()
        manager = self.rollout.manager
        metrics = manager.batch_metrics(groups, stream_metrics.pop("rollout/dropped_groups"), 0,
                                        time.perf_counter() - began)
        samples, metrics = self.rollout.handed_over(RolloutOutput(groups, {**metrics, **stream_metrics}))
        metrics.update(self.staleness_metrics(samples, rollout_id))
        return samples, metrics

    async def step_push(self, version: str) -> None:
        if self.rollout.engine is None:  # a model-parallel group's other ranks: their part of rank 0's push
            await self.weight_sync.push(version)
            return
        await self.stream.update_weights(int(version), lambda: self.weight_sync.push(version))

    def untrained(self) -> list[list]:
        return self.stream.untrained()


class ScheduledRollout:
    """``state.rollout`` under an async schedule: ``generate`` hands over the schedule's batch, ``evaluate``
    waits until nothing of the schedule can pause the engines, ``state_dict`` keeps the untrained groups; the rest
    is the wrapped ``LoopRollout``'s."""

    def __init__(self, schedule: _Async):
        self.schedule = schedule

    def __getattr__(self, name):
        return getattr(self.schedule.rollout, name)

    async def generate(self, rollout_id: int):
        return await self.schedule.batch(rollout_id)

    async def evaluate(self, rollout_id: int):
        await self.schedule.settle()
        return await self.schedule.rollout.evaluate(rollout_id)

    def state_dict(self) -> dict:
        """The wrapped rollout's state, with every generated-and-untrained group first in the data source's
        buffer (served first after a resume, finished samples as they are, the rest continued). Collective under
        torchrun (a checkpoint's, on every process): rank 0's schedule alone generates, and a rollout of it that
        failed ahead of the trainer is raised there and reported on every process (``DataParallel.from_main``)
        instead of leaving them in the checkpoint's barrier."""
        state = self.schedule.rollout.state_dict()
        untrained: list[list] = []  # rank 0's; the other processes' schedules generate nothing
        self.schedule.state.dp.from_main(lambda: untrained.extend(self.schedule.untrained()))
        state["data_source"]["buffer"] = ([[dataclasses.asdict(s) for s in group] for group in untrained]
                                          + state["data_source"]["buffer"])
        return state


class ScheduledWeightSync:
    """``state.weight_sync`` under an async schedule: ``push`` pushes when the schedule says (every
    ``--update-weights-interval`` steps, at the point the schedule allows); the rest is the wrapped sync's."""

    def __init__(self, schedule: _Async):
        self.schedule = schedule

    def __getattr__(self, name):
        return getattr(self.schedule.weight_sync, name)

    @property
    def timings(self) -> dict[str, float]:
        return self.schedule.weight_sync.timings

    def close(self):
        """The wrapped sync's ``close()`` coroutine, after the helper thread has given the loop back: a step that
        failed while training leaves it running the loop, and the run's shutdown starts here."""
        self.schedule.overlap_end()
        return self.schedule.weight_sync.close()

    async def push(self, version: str) -> None:
        await self.schedule.push(version)
