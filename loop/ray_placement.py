"""Where the trainer ranks of a Ray run go: one placement group, one bundle per GPU, and the logical → physical map.

The group holds ``actor_num_nodes × actor_num_gpus_per_node`` bundles (and with ``--no-colocate`` one more per
engine GPU, ``--rollout-num-gpus``), ``{"GPU": 1, "CPU": c}`` each (``{"CPU": c}`` on a cluster without GPUs; c an
even share of the cluster's CPUs), strategy ``PACK``. Ray decides which node and GPU a bundle lands on; a probe task
on every bundle reports it (node IP, node id, GPU id), and the bundles are sorted by node, then GPU id, as slime
does, so rank r is the r-th slot of that order: neighbouring ranks share a node, and rank 0's node hosts the
rendezvous.
"""

from dataclasses import dataclass

READY_TIMEOUT_S = 300.0  # a group Ray cannot place in this time (too few GPUs/CPUs in the cluster) fails the start


@dataclass(frozen=True)
class Slot:
    """One bundle of the group: where Ray put it. ``gpu``: the GPU id on its node (None on a CPU bundle)."""

    bundle_index: int
    node_ip: str
    node_id: str
    gpu: int | None
    free_port: int  # a port that was free on the node when probed (rank 0's serves the rendezvous)


def bundle_for(cluster: dict[str, float], count: int) -> dict[str, float]:
    """One rank's bundle in a cluster of ``cluster`` resources: a GPU when it has GPUs, and an even share of its
    CPUs (at least one). Ray sets a rank's OMP_NUM_THREADS to its CPUs, so the share is also its torch threads: a
    single rank on a CPU machine computes with every core, as it does without Ray."""
    cpus = max(1, int(cluster.get("CPU", 1)) // count)
    return {"GPU": 1, "CPU": cpus} if cluster.get("GPU", 0) > 0 else {"CPU": cpus}


def actor_resources(bundle: dict[str, float]) -> dict[str, float]:
    """The ``.options`` resources of an actor (or task) that takes a whole bundle."""
    return {"num_gpus": bundle.get("GPU", 0), "num_cpus": bundle["CPU"]}


def shared_bundle(bundle: dict[str, float]) -> dict[str, float]:
    """The ``.options`` resources of each of two actors sharing one bundle (a trainer rank and the host of its
    colocated engine process): half its GPU, so Ray gives both the bundle's GPU, and half its CPUs (a fraction:
    a bundle of one CPU holds both). Each computes with all the bundle's CPUs (``threads_env``): they take turns."""
    return {key: value / 2 for key, value in actor_resources(bundle).items() if value}


def place(ray, count: int, bundle: dict[str, float]):
    """``(placement group, slots)``: the group of ``count`` bundles once Ray has reserved it, and its slots in
    logical order (sorted by node IP, node id, GPU id)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"Ray could not reserve {count} bundle(s) of {bundle} within {READY_TIMEOUT_S:.0f} s; "
                           f"cluster resources: {ray.cluster_resources()}")
    probe = ray.remote(_where_am_i)
    found = ray.get([probe.options(**actor_resources(bundle), scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=i)).remote(i) for i in range(count)])
    return group, sorted((Slot(*f) for f in found), key=lambda s: (s.node_ip, s.node_id, s.gpu or 0))


def _where_am_i(bundle_index: int) -> tuple:
    """In a task on one bundle: ``Slot`` fields of that bundle."""
    import ray
    from redline.ports import free_port

    gpus = ray.get_gpu_ids()
    return (bundle_index, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
            int(gpus[0]) if gpus else None, free_port())


def rank_env(slots: list[Slot], rank: int, world: int) -> dict[str, str]:
    """The environment ``torchrun`` gives trainer rank ``rank`` of ``world`` (the first ``world`` slots;
    ``redline.loop.data_parallel.init_data_parallel`` reads it): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on
    rank 0's node. On GPUs the rank sees the group's GPUs on its node, in GPU-id order (CUDA_VISIBLE_DEVICES, Ray
    told not to narrow it), and LOCAL_RANK is its own among them, as under ``torchrun``; with ``--no-colocate``
    the engine bundles' GPUs on its node follow the trainer's, cuda:1 ... to it (the SGLang servers it launches
    use them; embedded engines run in actors of their own, ``redline.loop.ray_engines``). On CPU bundles LOCAL_RANK
    is its index among its node's ranks."""
    slot = slots[rank]
    env = {"RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(sum(s.node_id == slot.node_id for s in slots[:world])),
           "MASTER_ADDR": slots[0].node_ip, "MASTER_PORT": str(slots[0].free_port)}
    if slot.gpu is None:
        return {**env, "LOCAL_RANK": str([s.node_id for s in slots[:rank]].count(slot.node_id))}
    visible = sorted(s.gpu for s in slots if s.node_id == slot.node_id)
    return {**env, "LOCAL_RANK": str(visible.index(slot.gpu)), "CUDA_VISIBLE_DEVICES": ",".join(map(str, visible)),
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
