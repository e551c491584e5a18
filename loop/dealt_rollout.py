"""``--no-colocate`` under data parallelism: one set of engines, driven by global rank 0, for every DP rank.

The engines (``--rollout-num-gpus`` of them, on the GPUs after all of the trainer's) are rank 0's: it alone starts
them, generates and evaluates. Its ``RolloutManager`` draws each rollout's whole batch from the unsharded prompt
stream (``rollout_shard``: one process's), so the batch is the single-process ``--no-colocate`` run's. The step
(``rollout_batch``) then deals the batch's groups to the DP ranks, group ``k`` to DP rank ``k mod DP`` — the groups a
colocated DP rank draws from its own ``DataSource`` shard — by ``DataParallel.exchange_samples`` among the
model-parallel groups' leaders, and each leader hands its share to its group (``from_model_leader``); from there on
the step is the colocated data-parallel one (log-probs and advantages on each rank's share, micro-batches dealt by
token load). Rank 0's rollout metrics describe the whole batch: every rank gets them (the counts on rank 0 alone),
so the step's data-parallel reduction leaves them as they are; they go out before the samples, and a rollout that
raises on rank 0 (an engine, the reward, the data) is raised there and reported on every other rank instead
(``DataParallel.from_rank``), none of them left waiting in the exchange. The evaluation is rank 0's, over the whole
eval set, its metrics handed to every process. Under ``--async-rollout one-step`` rank 0's schedule generates the
batches (a failed one raises when the step takes it, so here too) and the dealing still runs in the step, on the main
thread: its collectives never run beside the training's.

Every replica holds the same weights after the optimizer step, so only DP rank 0's model-parallel group pushes
(``BroadcastWeightSync``, or ``ModelParallelBroadcastSync`` under TP/PP); every other DP rank's ``ReplicaWeightSync``
takes part in nothing. No collective of the push reaches beyond that group and the weight-update group: the TP
gathers and PP sends run over the group's own TP and PP groups, the plan's exchange and the pass count over its own
pipeline and model-parallel groups, the broadcast over the weight-update group (rank 0 and the engines).
"""

import itertools

import torch.distributed as dist

from redline.loop.data_parallel import COUNT_METRICS, SINGLE_PROCESS, DataParallel


def deals_rollouts(config, dp: DataParallel) -> bool:
    """Whether rank 0's engines generate every DP rank's rollouts: ``--no-colocate`` with DP > 1."""
    return not config.parallel.colocate and dp.world > 1


def generates(config, dp: DataParallel) -> bool:
    """Whether this process drives engines and generates: global rank 0 with dealt rollouts, else every DP rank's
    model-parallel leader (``DataParallel.holds_engine``)."""
    return dp.is_main if deals_rollouts(config, dp) else dp.holds_engine


def rollout_shard(config, dp: DataParallel) -> DataParallel:
    """The data parallelism this process's rollouts run under (its prompt shard, its evaluation's shard and
    averaging): one process's with dealt rollouts (rank 0 draws the whole batch and evaluates every prompt)."""
    return SINGLE_PROCESS if deals_rollouts(config, dp) else dp


def rollout_batch(state, rollout_id: int) -> tuple[list, dict[str, float]]:
    """This process's samples of rollout ``rollout_id`` and the rollout's metrics (collective: every process
    calls). Each model-parallel group's leader generates for its DP rank, or with dealt rollouts rank 0 generates
    the whole batch and deals it out; the leader hands its share to its group. What the generation raises is
    raised where it ran and reported on every other process of the collective (a ``RuntimeError`` naming the rank
    and the exception; ``ValueError`` for a ``ValueError``)."""
    dp = state.dp

    def generate():
        return state.loop.run_until_complete(state.rollout.generate(rollout_id))

    if not deals_rollouts(state.config, dp):
        return dp.from_model_leader(generate)
    return dp.from_model_leader(lambda: deal(dp, generate))


def deal(dp: DataParallel, generate) -> tuple[list, dict[str, float]]:
    """DP rank 0's whole batch, from ``generate()`` (called there alone: ``(samples in group order, metrics of
    the batch)``), dealt over the DP group: group ``k`` to DP rank ``k mod DP``, each rank's groups in batch order.
    Every rank gets the metrics, with the counts (``COUNT_METRICS``, summed by ``reduce_metrics``) zero beyond DP
    rank 0. The metrics go out first, by ``DataParallel.from_rank``: whatever ``generate`` raises is raised on DP
    rank 0 and reported on every other rank there, so none waits in the sample exchange for a batch that never
    comes. Collective over ``dp.group``: in a model-parallel run, its leaders call it."""
    samples = []  # DP rank 0's batch; the other ranks own no samples

    def batch_metrics():
        batch, metrics = generate()
        samples.extend(batch)
        return metrics

    metrics = dp.from_rank(batch_metrics, dist.get_global_rank(dp.group, 0) if dp.group is not None else 0,
                           group=dp.group)
    needed = [[] for _ in range(dp.world)]  # read on DP rank 0 alone, the only rank that owns samples
    groups = itertools.groupby(range(len(samples)), key=lambda i: samples[i].group_index)
    for k, (_, ids) in enumerate(groups):
        needed[k % dp.world].extend(ids)
    pool, _ = dp.exchange_samples(samples, {}, needed)
    shared = metrics if dp.rank == 0 else {k: 0.0 if k in COUNT_METRICS else v for k, v in metrics.items()}
    return [pool[i] for i in sorted(pool)], shared


def evaluation(state, rollout_id: int) -> dict[str, float]:
    """The eval metrics on every process (collective): each DP rank's leader evaluates its shard (averaged over
    the DP ranks), or with dealt rollouts rank 0 evaluates every eval prompt."""
    dp = state.dp

    def evaluate():
        return state.loop.run_until_complete(state.rollout.evaluate(rollout_id))

    return dp.from_main(evaluate) if deals_rollouts(state.config, dp) else dp.from_model_leader(evaluate)


class ReplicaWeightSync:
    """The weight sync of a DP rank beyond the first with dealt rollouts: its replica's weights are DP rank 0's,
    whose group pushes them to the engines; this one joins no collective of the push. ``timings`` after a push
    has the keys its counterpart in DP rank 0's group records (``perf/sync_time``; ``perf/check_weights_time``
    where that is rank 0 checking SGLang servers, ``checks``), at 0: the step's metrics are reduced over the DP
    ranks, which need the same keys (the reduction takes the slowest rank's time, rank 0's)."""

    def __init__(self, dp: DataParallel, *, checks: bool):
        self.dp = dp
        self.keys = ["perf/sync_time"] + (["perf/check_weights_time"] if checks else [])
        self.timings: dict[str, float] = {}

    async def connect(self) -> None:
        """Nothing to join: the weight-update group is rank 0's and the engines'."""

    async def release(self) -> None:
        self.timings = {}

    async def push(self, version: str) -> None:
        self.timings = dict.fromkeys(self.keys, 0.0)

    async def close(self) -> None:
        """Nothing to leave."""

    def describe(self) -> str:
        return (f"weight sync: none from this rank (data-parallel rank {self.dp.rank}): DP rank 0's group pushes the "
                "weights every replica holds to the engines")
