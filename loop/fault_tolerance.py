"""Engine fault tolerance in the loop: when it is on, what it wraps, and the weight sync of a restarted engine.

On by default under ``--ray-address``, elsewhere with ``--use-fault-tolerance`` (``--no-use-fault-tolerance``
turns it off under Ray). It watches engines in processes of their own (``--embedded-engine-process``), one per
trainer rank, colocated: a restarted engine is caught up by a fresh ``WeightSync`` over it. An in-process engine
dies with its trainer (``--auto-resume`` covers that); SGLang servers and ``--no-colocate`` engines are not
restarted yet (a restarted broadcast receiver would have to rebuild the weight-update group with every engine).
"""

from redline.configfile import ConfigError
from redline.rollout.fault_tolerance import FaultTolerantEngine


def fault_tolerance_on(config) -> bool:
    r = config.rollout
    return r.use_fault_tolerance if r.use_fault_tolerance is not None else bool(config.parallel.ray_address)


def check_fault_tolerance(config) -> None:
    """At start-up, before any model loads: ``--use-fault-tolerance`` where it cannot act is a ConfigError."""
    from redline.loop.rollout_setup import resolve_engine

    if not config.rollout.use_fault_tolerance:
        return
    if not config.parallel.colocate:
        raise ConfigError("--use-fault-tolerance restarts colocated engine processes; --no-colocate engines are not "
                          "restarted yet (a restarted engine would have to rebuild the weight-update group)")
    if resolve_engine(config) != "embedded" or not config.rollout.embedded_engine_process:
        raise ConfigError("--use-fault-tolerance restarts embedded engine processes: add --embedded-engine-process "
                          "(--rollout-engine embedded); SGLang servers and an engine in the trainer's process are "
                          "not restarted")


def watched_engine(config, start):
    """The run's engine from ``start()``, behind ``FaultTolerantEngine`` when fault tolerance is on and the engine
    runs in a process of its own; ConfigError when ``--use-fault-tolerance`` asks for it where it cannot act."""
    engine = start()
    if not fault_tolerance_on(config):
        return engine
    supported = config.parallel.colocate and hasattr(engine, "kill")
    if not supported:
        if config.rollout.use_fault_tolerance:
            engine_kind = "--no-colocate engines" if not config.parallel.colocate else "an engine in this process"
            raise ConfigError(f"--use-fault-tolerance restarts colocated engine processes "
                              f"(--embedded-engine-process); this run has {engine_kind}")
        return engine
    r = config.rollout
    return FaultTolerantEngine(start, first=engine, interval=r.rollout_health_check_interval,
                               timeout=r.rollout_health_check_timeout, first_wait=r.rollout_health_check_first_wait)


def engine_sync(engine, make_sync):
    """The weight sync of the run's colocated ``engine``: ``make_sync(engine)``, or for a watched engine a
    ``RestartingWeightSync`` that builds ``make_sync`` again over each restarted engine."""
    if isinstance(engine, FaultTolerantEngine):
        return RestartingWeightSync(engine, make_sync)
    return make_sync(engine)


class RestartingWeightSync:
    """A ``WeightSync`` (``redline.loop.weight_sync``) over the engine a ``FaultTolerantEngine`` holds now. A
    restarted engine gets a new one, and the weights of the last push (the trainer's weights between a push and
    the next optimizer step) under that version, before it serves; an engine found dead before a push is replaced
    first. Everything else is the ``WeightSync``'s."""

    def __init__(self, engines: FaultTolerantEngine, make_sync):
        (engine,) = engines.engines  # colocated: one engine per trainer rank
        self.engines, self.make_sync = engines, make_sync
        self.inner = make_sync(engine)
        self.version: str | None = None  # None: the engine holds the weights it loaded from the checkpoint
        engines.restore = self._restore

    async def _restore(self, engine) -> None:
        await self.inner.close()
        self.inner = self.make_sync(engine)
        if self.version is not None:
            await self.inner.push(self.version)

    async def push(self, version: str) -> None:
        await self.engines.replace_dead()
        await self.inner.push(version)
        self.version = version

    async def release(self) -> None:
        await self.inner.release()

    async def close(self) -> None:
        await self.inner.close()

    def describe(self) -> str:
        e = self.engines
        return (f"{self.inner.describe()} · fault tolerance: health checks every {e.interval:g} s (timeout "
                f"{e.timeout:g} s), a dead engine restarted with the current weights")

    def __getattr__(self, name):  # timings, offload, mode, plan ...: the current WeightSync's
        return getattr(self.__dict__["inner"], name)


def arm_injected_fault(engine, rollout_id: int) -> None:
    """``REDLINE_FAULT=kill-engine:K@rollout:R`` (``redline.loop.faults``): arm the kill of engine K in rollout R."""
    from redline.loop.faults import engine_to_kill

    index = engine_to_kill(rollout_id)
    if index is None:
        return
    if not isinstance(engine, FaultTolerantEngine):
        raise ValueError("REDLINE_FAULT kill-engine needs fault tolerance over engine processes "  # noqa: TRY004
                         "(--use-fault-tolerance --embedded-engine-process)")
    engine.kill_after_first_result(index)


def fault_metrics(engine) -> dict[str, float]:
    """This rollout's ``rollout/engine_restarts`` and ``rollout/retried_requests`` ({} without fault tolerance)."""
    return engine.take_metrics() if isinstance(engine, FaultTolerantEngine) else {}
