"""Data parallelism for ``redline train`` under ``torchrun``: every rank a trainer with its own colocated engine.

Each rank generates its shard of every rollout batch (the prompt stream is split by ``DataSource`` rank), scores
it and computes log-probs and advantages on it (groups never straddle ranks). For training, each optimizer
step's token-budget micro-batches are dealt out across the ranks by token load (``balance_across_ranks``, from
every rank's sample lengths), and each rank then receives from the others only the samples of its own
micro-batches (``exchange_samples``). Loss weights are normalised by the whole batch's total (``loss_weights``) and
gradients are averaged over the ranks before clipping, so each optimizer step is the one a single process would
take on the whole batch, and every rank holds the same weights, which it then pushes into its own engine.
Metrics are reduced over the ranks; rank 0 writes the files.

With tensor / pipeline parallelism (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``) the
processes form a DP × PP × TP mesh (``redline.trainer.parallel``): ``rank``/``world`` here are the data-parallel
coordinate and size, every collective of this class runs over the DP group only, and the TP × PP ranks of one DP
rank (its model-parallel group) hold the same data: its leader (TP rank 0 of the first stage) alone generates and
evaluates, and hands the samples to the rest of the group (``from_model_leader``).
"""

import os
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

COUNT_METRICS = ("rollout/dropped_groups", "rollout/discarded_groups", "rollout/returned_groups",
                 "rollout/engine_restarts", "rollout/retried_requests", "rollout/samples")


@dataclass(frozen=True)
class DataParallel:
    """This process's place among ``world`` data-parallel ranks; ``state`` is the trainer's
    ``redline.trainer.parallel.ParallelState`` (None in a single process); ``mp_group``: the TP × PP ranks sharing
    this DP rank's data (None without model parallelism)."""

    rank: int = 0
    world: int = 1
    state: object | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mp_group: object | None = None

    @property
    def is_main(self) -> bool:
        """Global rank 0: it writes the run's files."""
        return self.process_rank == 0

    @property
    def process_rank(self) -> int:
        return dist.get_rank() if self.state is not None else self.rank

    @property
    def processes(self) -> int:
        """Every process of the run (DP × TP × PP)."""
        return dist.get_world_size() if self.state is not None else self.world

    @property
    def model_parallel(self) -> bool:
        return self.mp_group is not None

    @property
    def holds_engine(self) -> bool:
        """Whether this process generates: every DP rank without model parallelism, else its group's leader."""
        return self.mp_group is None or (self.state.tp_rank == 0 and self.state.pp_rank == 0)

    @property
    def group(self):
        """The DP process group (None: the default group, the same ranks without model parallelism)."""
        return self.state.dp_group if self.mp_group is not None else None

    def from_model_leader(self, make):
        """``make()`` run by the leader of this model-parallel group (``holds_engine``), its picklable result
        handed to the group's other ranks, or what it raises reported to them (``from_rank``); without model
        parallelism, ``make()`` here."""
        if self.mp_group is None:
            return make()
        return self.from_rank(make, dist.get_global_rank(self.mp_group, 0), group=self.mp_group)

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any process of the run (all of them call)."""
        if self.processes == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value)
        return bool(value.item() > 0)

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks."""
        return float(self.sum_tensor(torch.tensor(float(value), dtype=torch.float64)))

    def sum_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (any device) summed element-wise over the ranks, returned on the CPU."""
        if self.world == 1:
            return values.cpu()
        values = values.to(self.device, copy=True)
        dist.all_reduce(values, group=self.group)
        return values.cpu()

    def all_lengths(self, lengths: list[int]) -> list[int]:
        """Every rank's per-sample lengths, concatenated in rank order (the pooled order of
        ``exchange_samples``); the same list on every rank."""
        if self.world == 1:
            return list(lengths)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, list(lengths), group=self.group)
        return [n for rank_lengths in gathered for n in rank_lengths]

    def exchange_samples(self, samples: list, per_token: dict[str, list], needed: list[list[int]]
                         ) -> tuple[list | dict, dict[str, list | dict]]:
        """The samples (and their per-sample values) this rank trains on, keyed by pooled index (rank r's i-th
        sample is ``r · len(samples) + i``; every rank holds the same number, or none: rank 0 dealing a batch it
        alone holds, ``redline.loop.dealt_rollout``). ``needed[r]``: the pooled indices rank r trains on, the same
        lists on every rank that holds samples (only those read them). Each rank sends every other rank only the
        samples it owns and that rank needs (one scatter per source rank), so a rank receives its share of the
        rollout, not all of it. A single process gets its own lists back."""
        if self.world == 1:  # the pooled indices are this rank's own list positions
            return samples, per_token
        base, count = self.rank * len(samples), len(samples)

        def owned(ids):
            return [(i, samples[i - base], {k: v[i - base] for k, v in per_token.items()})
                    for i in ids if base <= i < base + count]

        bundles = []
        for src in range(self.world):
            box = [None]
            dist.scatter_object_list(box, [owned(ids) for ids in needed] if src == self.rank else None,
                                     src=self._global(src), group=self.group)
            bundles.append(box[0])
        pool, values = {}, {key: {} for key in per_token}
        for index, sample, sample_values in (item for bundle in bundles for item in bundle):
            pool[index] = sample
            for key, value in sample_values.items():
                values[key][index] = value
        return pool, values

    def loss_weights(self, units: list[float]) -> list[float]:
        """Per-micro-batch loss weights from this rank's aggregation units (tokens, sequences): each unit over the
        total on all ranks, times ``world`` (the gradient average over ranks divides by it again)."""
        total = max(self.sum(sum(units)), 1)
        return [u * self.world / total for u in units]

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """One record for the step: phase times (``perf/*_time``) take the slowest rank, group counts the sum,
        everything else the mean. Every rank must pass the same keys: checked first (their count and a CRC-32 of
        the names, one small all-reduce), and a mismatch raises on every rank naming the keys, instead of a
        reduction of unequal tensors that hangs or averages the wrong values."""
        if self.world == 1:
            return dict(metrics)
        keys = sorted(metrics)
        self._check_same_keys(keys)
        is_time = [k.startswith("perf/") and k.endswith("_time") for k in keys]
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=self.device)
        slowest = values.clone()
        dist.all_reduce(values, group=self.group)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        out = {}
        for key, total, worst, time in zip(keys, values.tolist(), slowest.tolist(), is_time):
            out[key] = worst if time else total if key in COUNT_METRICS else total / self.world
        return out

    def _check_same_keys(self, keys: list[str]) -> None:
        signature = [len(keys), zlib.crc32("\n".join(keys).encode())]
        bounds = torch.tensor(signature + [-v for v in signature], dtype=torch.float64, device=self.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)  # (max, -min) of each: equal iff same
        if bounds[:2].tolist() == [-v for v in bounds[2:].tolist()]:
            return
        every = [None] * self.world
        dist.all_gather_object(every, keys, group=self.group)
        common = set.intersection(*map(set, every))
        raise RuntimeError("the ranks' step metrics differ; "
                           + "; ".join(f"rank {r} alone has {sorted(set(k) - common)}" for r, k in enumerate(every)
                                       if set(k) - common))

    def weighted_mean(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """``Σ_r weight_r · metrics_r / Σ_r weight_r``: means over shards of unequal size (eval prompts)."""
        if self.world == 1:
            return dict(metrics)
        keys = sorted(metrics)
        totals = self.sum_tensor(torch.tensor([float(metrics[k]) * weight for k in keys] + [float(weight)],
                                              dtype=torch.float64)).tolist()
        return {k: v / totals[-1] for k, v in zip(keys, totals[:-1])}

    def from_main(self, make):
        """``make()`` run on rank 0 only, its result (picklable) handed to every rank (``from_rank``)."""
        return self.from_rank(make, 0)

    def from_rank(self, make, src: int, group=None):
        """``make()`` run on global rank ``src`` only, its result (picklable) handed to every rank of ``group`` (a
        process group holding ``src``; None: every process), all of which call. Whatever it raises is raised on
        ``src`` and reported on every other rank (``ValueError`` for a ``ValueError``, ``ConfigError`` included;
        ``RuntimeError`` otherwise, both naming ``src`` and the exception's type and text), so no rank waits for a
        result that never comes."""
        if self.processes == 1:
            return make()
        box, error = [None, None], None
        if self.process_rank == src:
            try:
                box[0] = make()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
                error, box[1] = exc, (isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=src, group=group, device=self.device)
        if error is not None:
            raise error
        if box[1] is not None:
            is_value_error, message = box[1]
            raise (ValueError if is_value_error else RuntimeError)(f"on rank {src}: {message}")
        return box[0]

    def _global(self, dp_rank: int) -> int:
        """The global rank of DP rank ``dp_rank`` in this process's DP group."""
        return dist.get_global_rank(self.group, dp_rank) if self.group is not None else dp_rank

    def barrier(self) -> None:
        if self.processes > 1:
            dist.barrier()

    def close(self) -> None:
        if self.processes > 1 and dist.is_initialized():
            dist.destroy_process_group()


SINGLE_PROCESS = DataParallel()


def init_data_parallel(timeout_minutes: float, tp: int = 1, pp: int = 1, sp: bool = False, *,
                       first_stage_layers: int | None = None, last_stage_layers: int | None = None,
                       tp_overlap: str = "auto") -> DataParallel:
    """From ``torchrun``'s environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``): NCCL with one GPU per rank
    (``cuda:LOCAL_RANK``, made current), gloo on a CPU machine; a single process when ``WORLD_SIZE`` is unset/1.
    ``tp``/``pp``/``sp``: the model parallelism (``--tensor-model-parallel-size`` ...; ``first/last_stage_layers``:
    ``--decoder-first/last-pipeline-num-layers``; ``tp_overlap``: ``ParallelConfig.tp_overlap``, from
    ``--tp-comm-overlap``); the data-parallel size is
    what remains of the world (``validate.check_world_size`` refuses a world that does not split)."""
    from redline.loop.validate import check_world_size

    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(world, tp, pp)
    if world == 1:
        return DataParallel(device=torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    from redline.trainer.parallel import ParallelConfig

    if torch.cuda.is_available():
        local_rank, visible = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local_rank >= visible:
            raise RuntimeError(f"torchrun local rank {local_rank} needs its own GPU, but {visible} are visible "
                               "(CUDA_VISIBLE_DEVICES): start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(minutes=timeout_minutes), device_id=device if device.type == "cuda"
                            else None)
    dp = world // (tp * pp)
    state = ParallelConfig(tp=tp, pp=pp, dp=dp, sp=sp, tp_overlap=tp_overlap, first_stage_layers=first_stage_layers,
                           last_stage_layers=last_stage_layers).build(device.type)
    mp_group = model_parallel_group(state) if tp * pp > 1 else None
    return DataParallel(rank=state.dp_rank, world=dp, state=state, device=device, mp_group=mp_group)


def model_parallel_group(state) -> object:
    """The process group of this rank's TP × PP ranks (those of its DP coordinate), ordered stage-major with the
    leader (TP rank 0 of the first stage) first. Every process creates every group, in the same order."""
    size, mine = state.config.model_parallel, None
    for d in range(state.config.dp):
        group = dist.new_group(list(range(d * size, d * size + size)))  # ParallelConfig.global_rank's order
        if d == state.dp_rank:
            mine = group
    return mine
