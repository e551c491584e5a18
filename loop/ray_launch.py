"""``redline train --ray-address auto|local|ADDRESS``: the same run, its trainer ranks placed by Ray.

Ray is a placement, not a second loop. The driver (this process) reserves one placement group
(``redline.loop.ray_placement``: one bundle per GPU, PACK, slots sorted by node and GPU id), starts one
``TrainerRank`` actor per slot with the environment ``torchrun`` would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR = rank 0's node IP, MASTER_PORT), and each actor calls ``redline.loop.train.run``, the entry of
``redline train``: the same data-parallel group, the same step. Each rank's colocated engine is started by that
rank on its node and GPU: in its process, an SGLang server (its child), or an embedded engine process as an actor
sharing the rank's bundle (``_seats``; ``redline.loop.ray_engines``); engine fault tolerance is on by default here
(``redline.loop.fault_tolerance``). ``--no-colocate`` embedded engines get bundles of their own, wherever Ray places
them. The ranks take their batches from the rollout manager actor (``redline.loop.ray_rollout``).

``--auto-resume``: when a rank dies, every actor of the attempt is killed (the others would wait in a collective
until ``--distributed-timeout-minutes``) and new ones continue the run from its last checkpoint (``--load`` of the
run folder, whose ``metrics.jsonl`` keeps exactly the records up to it), at most ``--max-restarts`` times.
"""

import asyncio
import dataclasses
import json
import os
from pathlib import Path

from redline.configfile import ConfigError
from redline.loop.faults import ATTEMPT_ENV
from redline.loop.ray_engines import packed, unpacked
from redline.loop.ray_rollout import MANAGER_ENV, manager_name, relay, relay_each

PLACEMENT_FILE = "placement.json"
# what the ranks inherit from the driver's environment besides what Ray passes on (the fault plan of tests, the
# loop's own switches)
FORWARDED_ENV_PREFIXES = ("REDLINE_",)


def check_ray_flags(config) -> None:
    """Flags that only mean something under ``--ray-address``: ConfigError naming the flag."""
    p, c = config.parallel, config.checkpoint
    if p.ray_address:
        if p.actor_num_nodes < 1 or p.actor_num_gpus_per_node < 1:
            raise ConfigError("--actor-num-nodes and --actor-num-gpus-per-node must be >= 1")
        if c.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {c.max_restarts}")
        if config.rollout.async_rollout == "full":
            raise ConfigError("--async-rollout full is not yet on Ray: its generation stream runs beside the "
                              "trainer, and under --ray-address the rollout manager is an actor of its own; use "
                              "--async-rollout one-step, or run without --ray-address")
        return
    for flag, value in (("--rollout-manager", p.rollout_manager != "actor"),
                        ("--actor-num-nodes", p.actor_num_nodes != 1),
                        ("--actor-num-gpus-per-node", p.actor_num_gpus_per_node != 1),
                        ("--auto-resume", c.auto_resume)):
        if value:
            raise ConfigError(f"{flag} needs --ray-address (auto, local or a cluster address); under torchrun the "
                              "number of ranks is torchrun's --nproc-per-node/--nnodes")


class TrainerRank:
    """One trainer rank: the process ``torchrun`` would start, as a Ray actor. Asynchronous: ``run`` trains in a
    thread of its own while ``call`` answers the rollout manager actor's engine calls (``redline.loop.ray_rollout``)."""

    def __init__(self, env: dict[str, str]):
        os.environ.update(env)
        # the ray.get calls of the training thread block that thread, not the actor's event loop: Ray's warning of
        # a blocking get inside an async actor does not apply
        os.environ["RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"] = "0"

    def where(self) -> dict:
        """Where this rank runs, as the actor sees it: its node id and process id (its engine is its child), and
        what Ray's worker process gives it that a process of its own would not choose alike: its torch threads
        (Ray's OMP_NUM_THREADS) and its niceness."""
        import ray
        import torch

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "torch_threads": torch.get_num_threads(), "niceness": os.nice(0)}

    async def run(self, config, config_path) -> int:
        from redline.loop.train import run

        return await asyncio.to_thread(run, config, config_path)

    async def call(self, method: str, *args):
        """One of this rank's engine's methods, called by the rollout manager actor (as ``EngineHost.call``)."""
        return await relay(method, *args)

    async def generate_each(self, requests: bytes):
        """The rollout manager actor's generate calls on this rank's engine (as ``EngineHost.generate_each``)."""
        async for finished in relay_each(unpacked(requests)):
            yield packed(finished)


def run_on_ray(config, config_path=None) -> int:
    """Place and run ``config`` on the Ray cluster at ``--ray-address``; returns the exit code of rank 0."""
    from redline.extras import require

    check_ray_flags(config)
    ray = require("ray", "--ray-address")
    address = config.parallel.ray_address
    started_here = not ray.is_initialized()
    # the ranks' lines are the run's console: Ray must not fold the ones that repeat (a resumed step's line)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if started_here:
        ray.init(address=address, include_dashboard=False, logging_level="WARNING",
                 **(local_runtime(config) if address == "local" else {}))
    group = None
    try:
        from redline.loop import ray_placement

        world, size = group_size(config)
        bundle = ray_placement.bundle_for(ray.cluster_resources(), size)
        group, slots = ray_placement.place(ray, size, bundle)
        if size > world and _sglang(config) and len({s.node_id for s in slots}) > 1:
            raise ConfigError(f"--no-colocate SGLang on Ray: the trainer launches its {size - world} server(s) "
                              f"itself, so their bundles must share its node; Ray spread them over "
                              f"{len({s.node_id for s in slots})} nodes")
        # every attempt writes here; absolute, as a rank's working directory on another node may differ (the
        # folder must then be on a file system every node sees, as the config's other paths)
        out = Path(config.checkpoint.output_dir or _fixed_output_dir(config)).absolute()
        config = _replace(config, "checkpoint", output_dir=str(out))
        placement = _rows(slots, world)
        _announce(placement)
        try:
            return _attempts(ray, config, config_path, group, slots, world, placement,
                             _seats(config, slots, world, bundle))
        finally:
            if out.is_dir():  # written last: an --overwrite start empties the folder first
                (out / PLACEMENT_FILE).write_text(json.dumps(placement, indent=1) + "\n")
    finally:
        if group is not None:
            ray.util.remove_placement_group(group)
        if started_here:
            ray.shutdown()


def group_size(config) -> tuple[int, int]:
    """``(trainer ranks, bundles)``: one bundle per rank, and with ``--no-colocate`` one per engine GPU besides."""
    p = config.parallel
    world = p.actor_num_nodes * p.actor_num_gpus_per_node
    return world, world + (0 if p.colocate else p.rollout_num_gpus)


def _sglang(config) -> bool:
    from redline.loop.rollout_setup import resolve_engine

    return resolve_engine(config) == "sglang"


def _seats(config, slots, world: int, bundle: dict) -> list[tuple[dict, dict[str, str]]]:
    """Per trainer rank: its actor's options (resources; as many torch threads as the bundle has CPUs) and the
    engines' bundles it is given (``redline.loop.ray_engines``).
    A colocated engine process (``--embedded-engine-process``) shares the rank's bundle, each taking a share of it;
    ``--no-colocate`` embedded engines get the bundles after the trainer's; otherwise the rank takes its whole
    bundle and starts its engine itself (in its process, or an SGLang server)."""
    from redline.loop import ray_engines, ray_placement

    threads = int(bundle["CPU"])
    threads_env = {"runtime_env": ray_engines.threads_env(threads)}
    if _shares_bundle(config):
        share = ray_placement.shared_bundle(bundle)
        return [({**share, **threads_env}, {ray_engines.ENGINES_ENV: json.dumps(
            {"bundles": [slot.bundle_index], "resources": share, "threads": threads, "colocated": True})})
            for slot in slots[:world]]
    whole = ray_placement.actor_resources(bundle)
    if len(slots) == world or _sglang(config):
        return [({**whole, **threads_env}, {})] * world
    given = {"bundles": [s.bundle_index for s in slots[world:]], "resources": whole, "threads": threads,
             "colocated": False}
    return [({**whole, **threads_env}, {ray_engines.ENGINES_ENV: json.dumps(given)})] * world


def _shares_bundle(config) -> bool:
    return config.parallel.colocate and config.rollout.embedded_engine_process and not _sglang(config)


def local_runtime(config) -> dict:
    """``ray.init`` arguments of the runtime ``local`` starts: the CPUs this process may use (``usable_cpus``), at
    least one per bundle, so the placement group fits on a CPU machine; and the ranks at the driver's priority. Ray
    starts its workers at niceness 15 (``worker_niceness``), below its own daemons and every other process of the
    machine, which costs the host-bound step whenever anything else wants a core
    (benchmarks/results/loop/ray-cpu/README.md); a cluster started by ``ray start`` sets it there
    (``RAY_worker_niceness=0 ray start ...``), and so does the environment here."""
    system = {} if "RAY_worker_niceness" in os.environ else {"worker_niceness": 0}
    return {"num_cpus": max(usable_cpus(), group_size(config)[1]), "_system_config": system}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: ``taskset``, a cgroup cpuset, a batch scheduler's
    binding), which a local runtime's workers inherit; ``os.cpu_count()`` counts the whole machine, and would
    give the ranks more torch threads than they have cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fixed_output_dir(config) -> str:
    from redline.loop.train import output_dir_for

    return str(output_dir_for(config))


def _attempts(ray, config, config_path, group, slots, world, placement: list[dict], seats) -> int:
    from ray.exceptions import RayActorError

    restarts = config.checkpoint.max_restarts if config.checkpoint.auto_resume else 0
    for attempt in range(restarts + 1):
        actors = _start_ranks(ray, group, slots, world, attempt, seats, config.parallel.rollout_manager)
        try:
            for row, seen in zip(placement, ray.get([a.where.remote() for a in actors])):
                row.setdefault("attempts", []).append(seen)
            return _wait(ray, [a.run.remote(config, config_path) for a in actors])
        except RayActorError as exc:
            if attempt == restarts:
                print(f"trainer rank died ({type(exc).__name__}); "
                      + ("no restarts left (--max-restarts)" if restarts else "--auto-resume is off"), flush=True)
                return 1
            config, where = _resume_config(config, Path(config.checkpoint.output_dir))
            print(f"trainer rank died; restart {attempt + 1}/{restarts} from {where}", flush=True)
        finally:
            for actor in actors:
                ray.kill(actor)
    raise AssertionError("unreachable: the last attempt returns")


def _start_ranks(ray, group, slots, world: int, attempt: int, seats, manager_placement: str) -> list:
    """One ``TrainerRank`` per slot of the first ``world``, in its seat (``_seats``)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from redline.loop import ray_placement

    actor = ray.remote(max_restarts=0)(TrainerRank)
    inherited = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    # --rollout-manager rank: no actor named, each rank builds its manager itself (redline.loop.ray_rollout.on_ray)
    manager = {MANAGER_ENV: manager_name(attempt)} if manager_placement == "actor" else {}
    return [actor.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=slot.bundle_index)).remote(
        {**inherited, **ray_placement.rank_env(slots, rank, world), **engines_env, ATTEMPT_ENV: str(attempt),
         **manager})
        for rank, (slot, (options, engines_env)) in enumerate(zip(slots[:world], seats))]


def _wait(ray, pending: list) -> int:
    """Rank 0's exit code once every rank returned; the first rank failure raises at once (the others may be
    waiting for it in a collective)."""
    codes = {}
    remaining = list(pending)
    while remaining:
        done, remaining = ray.wait(remaining, num_returns=1)
        codes[done[0]] = ray.get(done[0])
    return codes[pending[0]] or max(codes.values())


def _resume_config(config, out: Path):
    """``(config, description)`` of the next attempt: ``--load`` of the run folder (its latest checkpoint), or, when
    none was saved yet, the run from the start in the same folder (``--overwrite``)."""
    from redline.loop.checkpoint import resolve

    try:
        folder = resolve(out)
    except (FileNotFoundError, ValueError):
        return _replace(config, "checkpoint", load=None, overwrite=True), "the start (no checkpoint yet)"
    return _replace(config, "checkpoint", load=str(out), overwrite=False), str(folder)


def _replace(config, section: str, **values):
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})


def _rows(slots, world: int) -> list[dict]:
    """The slot → (node, GPU, bundle) map, as ``placement.json`` in the run folder keeps it: the trainer ranks, then
    (``--no-colocate``) the engines' bundles; per attempt, the node id and process id each rank's actor reported."""
    return [{"rank" if i < world else "engine": i if i < world else i - world, "node_ip": s.node_ip,
             "node_id": s.node_id, "gpu": s.gpu, "bundle": s.bundle_index} for i, s in enumerate(slots)]


def _announce(placement: list[dict]) -> None:
    for row in placement:
        where = f"GPU {row['gpu']}" if row["gpu"] is not None else "CPU bundle"
        who = f"rank {row['rank']}" if "rank" in row else f"engine {row['engine']}"
        print(f"ray: {who} on node {row['node_ip']} ({row['node_id'][:8]}) {where}, bundle "
              f"{row['bundle']}", flush=True)
