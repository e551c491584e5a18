"""Where the rollout engines sit when one engine spans several GPUs (``--rollout-num-gpus-per-engine N``).

Colocated: every trainer rank owns one GPU (``cuda:LOCAL_RANK``), so an engine of N GPUs sits on the GPUs of N
consecutive ranks of one node: engine ``e`` on global ranks ``e·N .. e·N + N - 1``, engine TP rank ``i`` on the
GPU of rank ``e·N + i`` (SGLang puts TP rank ``i`` on ``--base-gpu-id + i``). The first of those ranks launches
the server and makes its control calls; each of the N ranks hands its engine TP rank its own GPU's copy of every
weight bucket (``redline.sync.sglang.gather_rank_payloads``, over a gloo group of the N ranks). Under a TP/PP trainer
(one engine per model-parallel group, on its leader) N is a multiple of TP × PP; the mesh puts data parallelism
outermost (``ParallelConfig.global_rank``), so a model-parallel group is TP × PP consecutive ranks and engine ``e``
spans exactly the groups of DP ranks ``e·N/(TP·PP) ..``: its leader leads the first of them and the leaders of
all of them generate on it (every launched engine is used). Each rank of the seat gets each bucket's full tensors
on its own GPU, one (bucket, stage) part at a time: gathered over TP by the part's stage, broadcast to the other
stages' ranks (``redline.loop.parallel_sync.seat_parts``). Ranks of a seat that generate (data-parallel ranks, or
the leaders of the other model-parallel groups in it) send their requests to the leader's server.

Disaggregated (``--no-colocate``): the trainer on ``cuda:0``, ``--rollout-num-gpus / N`` engines on the next GPUs,
engine ``e`` from ``cuda:1 + e·N`` on; the weight-update group is the trainer (rank 0) plus every engine GPU
(``redline.sync.broadcast.rank_offsets``).
"""

from __future__ import annotations

from dataclasses import dataclass

from redline.configfile import ConfigError

FLAG = "--rollout-num-gpus-per-engine"


@dataclass(frozen=True)
class EngineSeat:
    """This trainer rank's place in its colocated engine: ``engine`` (index), ``engine_rank`` (the engine TP rank
    on this rank's GPU) and ``ranks`` (the global trainer ranks on the engine's GPUs, in engine TP order).
    ``group``: the gloo group of ``ranks`` (None until ``join_engine_groups``)."""

    engine: int
    engine_rank: int
    ranks: tuple[int, ...]
    group: object | None = None

    @property
    def leader(self) -> int:
        """The rank that launches the engine and makes its HTTP calls (engine TP rank 0)."""
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.engine_rank == 0


def colocated_seat(rank: int, world: int, gpus_per_engine: int) -> EngineSeat:
    """The seat of global ``rank`` among ``world`` ranks, engines of ``gpus_per_engine`` GPUs."""
    if gpus_per_engine < 1 or world % gpus_per_engine:
        raise ValueError(f"{FLAG} {gpus_per_engine} does not divide the {world} trainer rank(s)")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    engine = rank // gpus_per_engine
    first = engine * gpus_per_engine
    return EngineSeat(engine, rank - first, tuple(range(first, first + gpus_per_engine)))


def join_engine_groups(seat: EngineSeat, world: int) -> EngineSeat:
    """``seat`` with its gloo group. Collective over the default group: every rank creates every engine's group,
    in engine order (``torch.distributed.new_group`` must be called by all ranks for each group)."""
    import torch.distributed as dist

    n = len(seat.ranks)
    mine = None
    for engine in range(world // n):
        group = dist.new_group(list(range(engine * n, engine * n + n)), backend="gloo")
        if engine == seat.engine:
            mine = group
    return EngineSeat(seat.engine, seat.engine_rank, seat.ranks, mine)


def disaggregated_base_gpus(rollout_num_gpus: int, gpus_per_engine: int, first_gpu: int = 1) -> list[int]:
    """``--no-colocate``: the first GPU of each engine (SGLang's ``--base-gpu-id``), engines back to back from
    ``first_gpu`` (the trainer holds the GPUs before it)."""
    if gpus_per_engine < 1 or rollout_num_gpus % gpus_per_engine:
        raise ValueError(f"{FLAG} {gpus_per_engine} does not divide --rollout-num-gpus {rollout_num_gpus}")
    return [first_gpu + e * gpus_per_engine for e in range(rollout_num_gpus // gpus_per_engine)]


def check_engine_gpus(config, *, engine: str, world_size: int, local_world_size: int) -> None:
    """Start-up checks of ``--rollout-num-gpus-per-engine`` (N) against the placement; ``engine`` is the resolved
    rollout engine, ``world_size`` / ``local_world_size`` the trainer's processes in all / on this node. Each
    refusal names the flags and their values."""
    p, n = config.parallel, config.parallel.rollout_num_gpus_per_engine
    if n < 1:
        raise ConfigError(f"{FLAG} must be >= 1, got {n}")
    if n == 1:
        return
    if engine != "sglang":
        raise ConfigError(f"{FLAG} {n}: only SGLang shards an engine over several GPUs; the {engine} engine runs "
                          f"on one GPU (unsharded, also beside a tensor-parallel trainer): add --rollout-engine "
                          f"sglang or set {FLAG} 1")
    if config.sync.check_sglang_weights or config.sync.check_weights:
        flag = "--check-sglang-weights" if config.sync.check_sglang_weights else "--check-weights"
        raise ConfigError(f"{flag} compares SGLang's /weights_checker hashes with whole tensors, but with {FLAG} "
                          f"{n} each server rank holds TP shards: drop {flag} or set {FLAG} 1")
    if config.rollout.use_fault_tolerance:
        raise ConfigError(f"--use-fault-tolerance restarts an engine from the rank that owns it; with {FLAG} {n} "
                          "an engine is shared by several ranks, which that restart does not reach: drop "
                          f"--use-fault-tolerance or set {FLAG} 1")
    if not p.colocate:
        if config.rollout.sglang_server_urls:
            return  # attached servers: N is their --tp-size, the GPUs are theirs already
        if p.rollout_num_gpus % n:
            raise ConfigError(f"--no-colocate: {FLAG} {n} must divide --rollout-num-gpus {p.rollout_num_gpus} "
                              f"(each engine takes {n} GPUs)")
        return
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if n % model_parallel:
        # an engine's leader must lead a model-parallel group, the ranks that generate (one engine per group)
        raise ConfigError(f"{FLAG} {n} colocated with --tensor-model-parallel-size {p.tensor_model_parallel_size} × "
                          f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size}: an engine must span "
                          f"whole model-parallel groups of {model_parallel} GPUs; use a multiple of {model_parallel}")
    if config.rollout.sglang_server_urls:
        raise ConfigError(f"{FLAG} {n} colocated: the trainer ranks on an engine's GPUs feed it their own copies "
                          "of the weights, so redline must launch it; drop --sglang-server-urls (or use "
                          "--no-colocate to attach servers)")
    if world_size % n or local_world_size % n:
        raise ConfigError(f"{FLAG} {n} colocated: each engine sits on the GPUs of {n} consecutive trainer ranks of "
                          f"one node, but the run has {world_size} rank(s), {local_world_size} on this node "
                          f"(torchrun --nproc-per-node): run a multiple of {n} processes per node")


def colocated_engine_seat(config) -> EngineSeat | None:
    """This rank's seat (with its gloo group) when colocated engines span several GPUs, else None. Collective over
    the default process group when not None."""
    n, p = config.parallel.rollout_num_gpus_per_engine, config.parallel
    if n == 1 or not p.colocate:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(f"{FLAG} {n} colocated needs {n} trainer ranks per engine: run under torchrun")
    world = dist.get_world_size()
    return join_engine_groups(colocated_seat(dist.get_rank(), world, n), world)


def share_engine_url(seat: EngineSeat, launch) -> tuple[object | None, str]:
    """Collective over ``seat.group``: the leader runs ``launch()`` (→ ``(engine, url)``) and hands the URL to the
    other ranks of the engine, which attach to it. Returns ``(engine, url)`` on the leader, ``(None, url)``
    elsewhere. A failed launch raises on the leader and, naming the leader, on every other rank (none waits
    for a URL that never comes)."""
    import torch.distributed as dist

    engine, box = None, [None]
    if seat.is_leader:
        try:
            engine, url = launch()
            box = [("url", url)]
        except BaseException as error:
            box = [("error", f"{type(error).__name__}: {error}")]
            dist.broadcast_object_list(box, src=seat.leader, group=seat.group)
            raise
    dist.broadcast_object_list(box, src=seat.leader, group=seat.group)
    kind, value = box[0]
    if kind == "error":
        raise RuntimeError(f"rank {seat.leader} failed to launch the engine this rank shares: {value}")
    return engine, value
