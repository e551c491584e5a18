"""Engine processes as Ray actors: ``--no-colocate`` engines on bundles of their own, on whatever node Ray placed
them, and a colocated engine process on its trainer rank's bundle.

The driver (``redline.loop.ray_launch``) reserves the engines' bundles after the trainer's and names them to the
trainer rank in ``REDLINE_RAY_ENGINES`` (JSON: ``{"bundles": [...], "resources": {...}, "threads": n,
"colocated": false}``). The rank starts one
``EngineHost`` actor per bundle; the actor starts an embedded engine process (``EmbeddedEngineProcess``) on its
node, on the bundle's GPU (Ray sets the actor's CUDA_VISIBLE_DEVICES, so it is ``cuda:0`` there) or its CPU. The
rank talks to it through ``RayEngine``, a ``redline.rollout.engine.Engine`` whose calls are the actor's, so the
step and the weight sync (``BroadcastWeightSync``) do not know the difference. The weight-update group meets on
the trainer rank's node IP (``weight_group_address``), which the engines' nodes can reach; without Ray it is
127.0.0.1, the engines being the trainer's children.

Colocated (``--embedded-engine-process``, ``"colocated": true``): the bundle is the rank's own, and the rank and
its engine's host each request a share of it (``redline.loop.ray_placement.shared_bundle``: half its GPU, so Ray
gives both that GPU, and half its CPUs). The rank reaches its engine as a ``ColocatedRayEngine``: the colocated
weight sync over CUDA IPC (shared memory on the CPU) and engine fault tolerance, as with the child it would
start without Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal

ENGINES_ENV = "REDLINE_RAY_ENGINES"


def packed(value) -> bytes:
    """``value`` as bytes for an actor call or a stream. Ray's own serializer (cloudpickle, a Python callback per
    object) took 4.7-5.0 ms to bring 200 requests to an actor method, their pickle's bytes 3.2-3.3 ms; the rollout
    of the quickstart under Ray went from 91.7-96.8 to 85.3-85.8 ms (results/loop/ray-cpu/packed/)."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpacked(data: bytes):
    """What ``packed`` packed."""
    return pickle.loads(data)


def engine_bundles() -> dict | None:
    """The engines' bundles this trainer rank was given (``{"bundles": [index, ...], "resources": {...},
    "threads": n, "colocated": bool}``), or None outside Ray or with engines in the rank's process or its
    children (an in-process engine, SGLang servers)."""
    text = os.environ.get(ENGINES_ENV)
    return json.loads(text) if text else None


def weight_group_address() -> str:
    """Where the weight-update group of ``--no-colocate`` meets: this node's IP when the engines are Ray actors
    (possibly on other nodes), else 127.0.0.1."""
    given = engine_bundles()
    if given is None or given["colocated"]:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class EngineHost:
    """A Ray actor holding one embedded engine process on its node; ``call`` runs one of the engine's methods,
    ``generate_each`` a batch of requests, each a call of its own, streaming the answers as they finish."""

    def __init__(self, make_engine, authkey: bytes | None = None, device: str | None = None):
        import multiprocessing

        import ray

        if authkey is not None:
            # the trainer rank's, inherited by the engine process: the rank connects to its weight channel with it,
            # and on the CPU the engine fetches the rank's shared memory handles with it
            multiprocessing.current_process().authkey = authkey
        gpus = ray.get_gpu_ids()
        self.engine = make_engine(device or ("cuda:0" if gpus else "cpu"))

    def where(self) -> dict:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "engine_pid": self.engine.pid, "weight_address": self.engine.weight_address}

    async def call(self, method: str, *args):
        return await getattr(self.engine, method)(*args)

    async def generate_each(self, requests: bytes):
        """``requests``: ``packed``; yields ``packed`` chunks of ``(index, result)``."""
        calls = [asyncio.ensure_future(self.engine.generate([r])) for r in unpacked(requests)]
        async for finished in as_they_finish(calls):
            yield packed(finished)


async def as_they_finish(calls: list):
    """Async generator over the futures ``calls`` (each a one-request generate call): yields ``[(index, result),
    ...]`` of the calls that finished since the last yield; cancels the rest when it is closed early or one fails."""
    pending = {call: index for index, call in enumerate(calls)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            yield [(pending.pop(call), call.result()[0]) for call in done]
    finally:
        for call in pending:
            call.cancel()


class RayEngine:
    """An ``Engine`` whose calls run in an actor (``EngineHost``, or a trainer rank answering the rollout manager
    actor: ``redline.loop.ray_rollout``), awaiting the actor's results.

    ``generate`` calls made in one turn of the event loop (the loop makes one per sample, a rollout's at once) go to
    the actor as one call (``generate_each``), whose answers stream back as they finish, a chunk of those finished
    since the last: an actor call costs about half a millisecond of the caller's time, so 200 of them took 108 ms
    per rollout on the CPU, one batched call 3 ms. Answers that finish one by one go back a chunk each; holding
    chunks back while the reader is behind (Ray's generator backpressure) cut their number by 28-32 % and gained
    no time (7-8 ms after the last answer either way, results/loop/ray-cpu/stream/), so the stream sends each as
    it comes. A caller still gets its answer when its own requests end, so the manager scores a group as it
    finishes and a pause aborts only what still runs. Each request keeps its own seed, so batching changes no
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
        task = asyncio.ensure_future(self._deliver(queued))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, queued) -> None:
        """Each caller of the batch ``queued`` its results once all of its requests have come back; the engine's
        error to every caller still waiting."""
        results = [[None] * len(requests) for requests, _ in queued]
        missing = [len(requests) for requests, _ in queued]
        owner = [(k, j) for k, (requests, _) in enumerate(queued) for j in range(len(requests))]
        batch = [request for requests, _ in queued for request in requests]
        for k, (_, answer) in enumerate(queued):
            if not missing[k]:
                answer.set_result([])
        try:
            async for chunk in self.actor.generate_each.options(num_returns="streaming").remote(packed(batch)):
                for index, result in unpacked(await chunk):
                    k, j = owner[index]
                    results[k][j] = result
                    missing[k] -= 1
                    answer = queued[k][1]
                    if not missing[k] and not answer.done():  # a cancelled caller: skipped
                        answer.set_result(results[k])
        except Exception as exc:  # noqa: BLE001 - every caller of the batch still waiting gets the engine's error
            for _, answer in queued:
                answer.done() or answer.set_exception(exc)

    async def join_weight_group(self, *args) -> None:
        await self._call("join_weight_group", *args)

    async def receive_weights(self, version: str, announced=None) -> None:
        await self._call("receive_weights", version)  # the engine process posts its receives from the plan

    async def leave_weight_group(self) -> None:
        await self._call("leave_weight_group")

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


class ColocatedRayEngine(RayEngine):
    """A ``RayEngine`` on its trainer rank's own bundle (a share of its GPU, or of its CPUs), so on the rank's node:
    its process is looked at and killed from here (``running``, ``pid``, ``kill``: what ``FaultTolerantEngine``
    needs) and the colocated weight sync reaches it directly (``weight_sender``: CUDA IPC, shared memory on the
    CPU), as the engine process the rank would start as its child."""

    @property
    def pid(self) -> int:
        return self.where["engine_pid"]

    def running(self) -> bool:
        """Whether the engine process runs (a killed one stays a zombie until its host reaps it)."""
        import psutil

        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def kill(self) -> None:
        """SIGKILL the engine process and its host actor; every call still waiting fails (``RayActorError``)."""
        import ray

        if self.running():
            os.kill(self.pid, signal.SIGKILL)
        ray.kill(self.actor)

    def weight_sender(self, plan, device, *, checksum_row_stride: int = 1, num_slots: int = 2,
                      timeout: float = 300.0):
        from redline.rollout.embedded.process import weight_sender_at

        return weight_sender_at(self.where["weight_address"], plan, device, alive=self.running,
                                checksum_row_stride=checksum_row_stride, num_slots=num_slots, timeout=timeout)

    async def release_memory(self, tags) -> None:
        await self._call("release_memory", set(tags))

    async def resume_memory(self, tags) -> None:
        await self._call("resume_memory", set(tags))


def start_engines(make_engine, device=None) -> list[RayEngine]:
    """One ``RayEngine`` per bundle of ``REDLINE_RAY_ENGINES``: ``make_engine(device)`` (picklable; it runs in the
    actor) builds the engine process there, with ``threads`` torch threads. ``colocated``: the bundle is this
    rank's own, the engine a ``ColocatedRayEngine`` whose process shares this process's authkey, and on a GPU
    (``device``, this rank's) sees the GPUs this rank sees and uses the rank's: CUDA IPC handles name the device as
    the sender numbers it. Returns once every engine has loaded its model."""
    import multiprocessing

    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    given = engine_bundles()
    group = ray.util.get_current_placement_group()
    if given is None or group is None:
        raise RuntimeError(f"{ENGINES_ENV} names the engines' bundles of the run's placement group; it is set by "
                           "the Ray launcher (redline train --ray-address) for --no-colocate runs and colocated "
                           "engine processes")
    colocated = given["colocated"]
    host = ray.remote(max_restarts=0)(EngineHost)
    authkey = bytes(multiprocessing.current_process().authkey) if colocated else None
    runtime_env = threads_env(given["threads"])
    on_gpu = colocated and device is not None and str(device).startswith("cuda")
    if on_gpu:
        runtime_env["env_vars"].update(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                                       RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1")
    actors = [host.options(**given["resources"], runtime_env=runtime_env,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               group, placement_group_bundle_index=index)).remote(
        make_engine, authkey, str(device) if on_gpu else None) for index in given["bundles"]]
    kind = ColocatedRayEngine if colocated else RayEngine
    engines = [kind(actor, where) for actor, where in zip(actors, ray.get([a.where.remote() for a in actors]))]
    for i, (engine, index) in enumerate(zip(engines, given["bundles"])):
        w = engine.where
        seat = (f" shared with its trainer rank, each taking {given['resources']}; weights by CUDA IPC / shared "
                f"memory" if colocated else f"; weight-update group on {weight_group_address()}")
        print(f"ray: engine {i} (process {w['engine_pid']}) on node {w['node_ip']} ({w['node_id'][:8]}), bundle "
              f"{index}{seat}", flush=True)
    return engines


def threads_env(threads: int) -> dict:
    """The ``runtime_env`` giving an actor's process ``threads`` torch threads (Ray gives a fractional CPU share
    one)."""
    return {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
