"""The rollout manager as a Ray actor (``redline train --ray-address``).

One ``RolloutManagerActor`` per attempt of a run (named by the launcher in ``REDLINE_RAY_ROLLOUT_MANAGER``;
created by the first rank that asks, so it dies with the attempt's ranks) holds, for every data-parallel rank that
generates, the ``RolloutManager`` of that rank's shard: the data position, the reward, the dynamic filter, the
partial-rollout buffer and the fan-out of one generate call per sample. The rank's ``LoopRollout`` talks to it
through ``RemoteManager``, which has the interface the loop uses of a ``RolloutManager`` (``generate_rollout``,
``state_dict`` / ``load_state_dict``, ``data_source.get_groups`` for the SFT warm-up, ``skipped_records``,
``engine``, ``close``), so the step and the checkpoints are the same code with and without Ray.

The engines stay where the rank placed them (in its process, its child process, an SGLang server, the engine
actors of ``--no-colocate``). SGLang servers the actor calls itself, over HTTP, as slime's rollout manager does:
the rank's engine names its workers and router (``SGLangEngine.endpoints``) and the actor generates on a client of
its own (``use_engine_directly``), with the weight version the rank last pushed; the rank's event loop takes no
part in the rollout. Every other engine the actor reaches through the rank's actor (``TrainerRank.call`` →
``relay``), which runs each call on the event loop the rank is awaiting its batch on, so the rank's fault
tolerance, injected faults and engine group see the calls they see without Ray. The actor batches the generate
calls of one event-loop turn into one actor call (``RayEngine``); the rank makes each request a generate call of
its own, as the loop makes them without Ray (an ``EngineGroup`` deals them out in turn), and streams the answers
back as they finish (``relay_each``). That relay is most of what Ray adds to a rollout: on the CPU quickstart the
hops in and out of the rank took 12.8 ms of a 172 ms step (``benchmarks/results/loop/ray-cpu/``).
"""

from __future__ import annotations

import asyncio
import os

MANAGER_ENV = "REDLINE_RAY_ROLLOUT_MANAGER"  # the rollout manager actor's name in this attempt (set by the launcher)

_served: dict = {}  # this rank's RemoteManager ("manager"): its engine answers the actor's calls


def on_ray() -> bool:
    """Whether this rank runs under the Ray launcher, with a rollout manager actor to ask for its batches."""
    return MANAGER_ENV in os.environ


def manager_name(attempt: int) -> str:
    """The rollout manager actor's name in attempt ``attempt`` (a restarted attempt gets a new actor)."""
    return f"redline-rollout-manager-{attempt}"


class RolloutManagerActor:
    """A Ray actor (async: the shards' rollouts run concurrently) holding each generating rank's
    ``RolloutManager``, built from the run's ``config`` here (tokenizer, prompt shard, reward, filter)."""

    def __init__(self, config):
        self.config = config
        self.shards: dict = {}
        self.direct: dict = {}  # rank -> this actor's client of the rank's SGLang servers

    def register(self, rank: int, world: int, trainer) -> int:
        """Build data-parallel rank ``rank``'s manager of ``world``, generating through ``trainer`` (the rank's
        actor handle); returns the prompt file's skipped malformed records."""
        from transformers import AutoTokenizer

        from redline.long_lived import freeze_long_lived
        from redline.loop.ray_engines import RayEngine
        from redline.loop.rollout_setup import build_manager, run_reward

        tokenizer = AutoTokenizer.from_pretrained(self.config.model.hf_checkpoint)
        manager = build_manager(self.config, tokenizer, RayEngine(trainer, {}), run_reward(self.config), rank=rank,
                                world=world)
        self.shards[rank] = manager
        freeze_long_lived()  # this process's tokenizer, data and libraries, out of its rollouts' full collections
        return manager.skipped_records

    def use_engine_directly(self, rank: int, endpoints: dict) -> None:
        """Rank ``rank``'s manager generates on the rank's SGLang servers itself: a client of ``endpoints``
        (``SGLangEngine.endpoints``; the servers stay the rank's)."""
        from redline.rollout.sglang.engine import SGLangEngine

        self.direct[rank] = self.shards[rank].engine = SGLangEngine(**endpoints)

    async def generate(self, rank: int, weight_version: str | None = None) -> bytes:
        """Rank ``rank``'s next batch, ``packed``. ``weight_version``: what the rank last pushed, for the answers of
        servers that report none (as the rank's own client fills them in)."""
        from redline.loop.ray_engines import packed

        direct = self.direct.get(rank)
        if direct is not None and weight_version is not None:
            direct.weight_version = weight_version
        return packed(await self.shards[rank].generate_rollout())

    def get_groups(self, rank: int, num_groups: int, n_samples_per_prompt: int):
        return self.shards[rank].data_source.get_groups(num_groups, n_samples_per_prompt)

    def state_dict(self, rank: int) -> dict:
        return self.shards[rank].state_dict()

    def load_state_dict(self, rank: int, state: dict) -> None:
        self.shards[rank].load_state_dict(state)

    async def close(self, rank: int) -> None:
        await self.shards[rank].close()
        direct = self.direct.pop(rank, None)
        if direct is not None:
            await direct.shutdown()  # its HTTP sessions only: it owns no server

    def where(self) -> dict:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}


class RemoteDataSource:
    """The shard's data source in the actor, as far as the SFT warm-up draws from it (``get_groups``)."""

    def __init__(self, actor, rank: int):
        self.actor, self.rank = actor, rank

    def get_groups(self, num_groups: int, n_samples_per_prompt: int):
        import ray

        return ray.get(self.actor.get_groups.remote(self.rank, num_groups, n_samples_per_prompt))


class RemoteManager:
    """This rank's shard of the rollout manager actor, with the ``RolloutManager`` interface the loop uses.
    ``engine``: the rank's engine, which answers the actor's engine calls (``relay``), or, SGLang servers, which the
    actor calls itself."""

    def __init__(self, actor, rank: int, world: int):
        import ray

        self.actor, self.rank = actor, rank
        self._engine = None
        self.data_source = RemoteDataSource(actor, rank)
        trainer = ray.get_runtime_context().current_actor
        self.skipped_records = ray.get(actor.register.remote(rank, world, trainer))  # fixed once the file is read
        w = ray.get(actor.where.remote())
        print(f"ray: data-parallel rank {rank}'s rollouts from the rollout manager actor (process {w['pid']}) on "
              f"node {w['node_ip']} ({w['node_id'][:8]})", flush=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        _served["manager"] = self

    @property
    def engine(self):
        return self._engine

    @engine.setter
    def engine(self, engine) -> None:
        """Set by the loop once the rank's engine runs (``build_rollout``). An engine that names its servers
        (``endpoints``: SGLang) makes the actor their client now, one blocking actor call; any other is relayed."""
        import ray

        self._engine = engine
        endpoints = getattr(engine, "endpoints", None)
        if endpoints is None:
            return
        where = endpoints()
        ray.get(self.actor.use_engine_directly.remote(self.rank, where))
        servers = len(where["worker_urls"])
        router = ", through the router" if where["router_url"] else ""
        print(f"ray: the rollout manager actor generates on data-parallel rank {self.rank}'s SGLang "
              f"server{'s' if servers > 1 else ''} itself ({servers}{router}), not through the rank", flush=True)

    async def generate_rollout(self):
        # the actor's engine calls run on this loop, which runs while the rank awaits the batch
        self._loop = asyncio.get_running_loop()
        from redline.loop.ray_engines import unpacked

        version = getattr(self._engine, "weight_version", None)
        return unpacked(await self.actor.generate.remote(self.rank, None if version is None else str(version)))

    def state_dict(self) -> dict:
        import ray

        return ray.get(self.actor.state_dict.remote(self.rank))

    def load_state_dict(self, state: dict) -> None:
        import ray

        ray.get(self.actor.load_state_dict.remote(self.rank, state))

    async def close(self) -> None:
        await self.actor.close.remote(self.rank)


def remote_manager(config, dp) -> RemoteManager:
    """This rank's shard of the attempt's rollout manager actor, created here when no rank has yet; beside the
    creating rank (its node), taking none of the placement group's bundles."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    actor = ray.remote(RolloutManagerActor).options(
        name=os.environ[MANAGER_ENV], get_if_exists=True, num_cpus=0, max_restarts=0,
        scheduling_strategy=here).remote(config)
    return RemoteManager(actor, dp.rank, dp.world)


def _on_rank_loop(call):
    """The coroutine ``call`` run on the loop this rank awaits its batch on, as a future of the running loop."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, _served["manager"]._loop))


async def relay(method: str, *args):
    """One engine call of the rollout manager actor (``TrainerRank.call``), on this rank's engine and on the loop
    that awaits the batch."""
    return await _on_rank_loop(getattr(_served["manager"].engine, method)(*args))


async def relay_each(requests):
    """``RayEngine.generate``'s batch (``TrainerRank.generate_each``): each request a generate call of its own on
    this rank's engine, as the loop makes them without Ray; yields the answers as they finish. The calls and their
    answers stay on the rank's loop, which hands this one a chunk at a time: a hop between the threads per request
    and per answer cost the generating thread 20 to 40 ms of a 200-sample rollout on the CPU (the quickstart)."""
    from redline.loop.ray_engines import as_they_finish

    engine = _served["manager"].engine
    here = asyncio.get_running_loop()
    chunks: asyncio.Queue = asyncio.Queue()

    async def fan_out():  # on the rank's loop
        calls = [asyncio.ensure_future(engine.generate([request])) for request in requests]
        async for finished in as_they_finish(calls):
            here.call_soon_threadsafe(chunks.put_nowait, finished)

    running = _on_rank_loop(fan_out())
    try:
        left = len(requests)
        while left:
            get = asyncio.ensure_future(chunks.get())
            await asyncio.wait([get, running], return_when=asyncio.FIRST_COMPLETED)
            if not get.done() and running.done() and (running.cancelled() or running.exception()):
                get.cancel()
                running.result()  # the engine's error
            finished = await get  # a finished fan-out's last chunks are on their way (queued before it ended)
            left -= len(finished)
            yield finished
    finally:
        running.cancel()  # closed early: the calls still running are cancelled on the rank's loop
