"""``--no-colocate`` under Ray: each engine on a bundle of its own, on whatever node Ray placed that bundle.

The driver (``redline.loop.ray_launch``) reserves the engines' bundles after the trainer's and names them to the
trainer rank in ``REDLINE_RAY_ENGINES`` (JSON: ``{"bundles": [...], "resources": {...}}``). The rank starts one
``EngineHost`` actor per bundle; the actor starts an embedded engine process (``EmbeddedEngineProcess``) on its
node, on the bundle's GPU (Ray sets the actor's CUDA_VISIBLE_DEVICES, so it is ``cuda:0`` there) or its CPU. The
rank talks to it through ``RayEngine``, a ``redline.rollout.engine.Engine`` whose calls are the actor's, so the
step and the weight sync (``BroadcastWeightSync``) do not know the difference. The weight-update group meets on
the trainer rank's node IP (``weight_group_address``), which the engines' nodes can reach; without Ray it is
127.0.0.1, the engines being the trainer's children.
"""

from __future__ import annotations

import asyncio
import json
import os

ENGINES_ENV = "REDLINE_RAY_ENGINES"


def engine_bundles() -> dict | None:
    """The engines' bundles this trainer rank was given (``{"bundles": [index, ...], "resources": {...}}``), or
    None outside Ray or with colocated engines."""
    text = os.environ.get(ENGINES_ENV)
    return json.loads(text) if text else None


def weight_group_address() -> str:
    """Where the weight-update group of ``--no-colocate`` meets: this node's IP when the engines are Ray actors
    (possibly on other nodes), else 127.0.0.1."""
    if engine_bundles() is None:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class EngineHost:
    """A Ray actor holding one embedded engine process on its node; ``call`` runs one of the engine's methods."""

    def __init__(self, make_engine):
        import ray

        gpus = ray.get_gpu_ids()
        self.engine = make_engine("cuda:0" if gpus else "cpu")

    def where(self) -> dict:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "engine_pid": self.engine.pid}

    async def call(self, method: str, *args):
        return await getattr(self.engine, method)(*args)


class RayEngine:
    """An ``Engine`` whose calls run in an ``EngineHost`` actor (``await`` on the actor's result).

    ``generate`` calls made in one turn of the event loop (the loop makes one per sample, a rollout's at once) go to
    the actor as one call: an actor call costs about half a millisecond of the trainer's time, so 200 of them took
    108 ms per rollout on the CPU, one batched call 3 ms. Each request keeps its own seed, so batching changes no
    answer."""

    weight_group_size = 1  # as the engine process it hosts: one device in the weight-update group
    joins_checksum_comparison = True

    def __init__(self, actor, where: dict):
        self.actor, self.where = actor, where
        self._queued: list | None = None  # this turn's (requests, future) pairs, sent once the turn ends
        self._sending: set[asyncio.Task] = set()  # batches in flight (held here: the loop keeps weak references)

    async def _call(self, method: str, *args):
        return await self.actor.call.remote(method, *args)

    async def generate(self, requests):
        loop = asyncio.get_running_loop()
        if self._queued is None:
            self._queued = []
            loop.call_soon(self._send)  # after every caller already scheduled in this turn has queued
        answer = loop.create_future()
        self._queued.append((list(requests), answer))
        return await answer

    def _send(self) -> None:
        queued, self._queued = self._queued, None
        batch = [request for requests, _ in queued for request in requests]
        task = asyncio.ensure_future(self._deliver(self._call("generate", batch), queued))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    @staticmethod
    async def _deliver(results, queued) -> None:
        try:
            results = await results
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the engine's error
            for _, answer in queued:
                answer.done() or answer.set_exception(exc)
            return
        first = 0
        for requests, answer in queued:
            answer.done() or answer.set_result(results[first:first + len(requests)])  # a cancelled caller: skipped
            first += len(requests)

    async def join_weight_group(self, *args) -> None:
        await self._call("join_weight_group", *args)

    async def receive_weights(self, version: str, announced=None) -> None:
        await self._call("receive_weights", version)  # the engine process posts its receives from the plan

    async def leave_weight_group(self) -> None:
        await self._call("leave_weight_group")

    async def set_weight_version(self, version) -> None:
        await self._call("set_weight_version", version)

    async def export_weights(self) -> list:
        return await self._call("export_weights")

    async def flush_cache(self) -> None:
        await self._call("flush_cache")

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def health(self) -> bool:
        return await self._call("health")

    async def shutdown(self) -> None:
        import ray

        try:
            await self._call("shutdown")
        finally:
            ray.kill(self.actor)


def start_engines(make_engine) -> list[RayEngine]:
    """One ``RayEngine`` per bundle of ``REDLINE_RAY_ENGINES``: ``make_engine(device)`` (picklable; it runs in the
    actor) builds the engine process there. Returns once every engine has loaded its model."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    given = engine_bundles()
    group = ray.util.get_current_placement_group()
    if given is None or group is None:
        raise RuntimeError(f"{ENGINES_ENV} names the engines' bundles of the run's placement group; it is set by "
                           "the Ray launcher (redline train --ray-address) for --no-colocate runs")
    host = ray.remote(max_restarts=0)(EngineHost)
    actors = [host.options(**given["resources"], scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=index)).remote(make_engine) for index in given["bundles"]]
    engines = [RayEngine(actor, where) for actor, where in zip(actors, ray.get([a.where.remote() for a in actors]))]
    for i, (engine, index) in enumerate(zip(engines, given["bundles"])):
        w = engine.where
        print(f"ray: engine {i} (process {w['engine_pid']}) on node {w['node_ip']} ({w['node_id'][:8]}), bundle "
              f"{index}; weight-update group on {weight_group_address()}", flush=True)
    return engines
