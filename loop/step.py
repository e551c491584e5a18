"""One RL step, top to bottom: rollout → log-probs → advantages → optimizer steps → weight sync.

Reads in order; each phase is timed into ``perf/*`` (``perf/idle_time``: the step's time outside them).
Everything the step needs lives in a ``RunState`` built once by ``redline.loop.train``.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from redline.gpu_telemetry import GpuTelemetry
from redline.kernels.reference import kl_estimate
from redline.loop.advantages import AdaptiveKLController, compute_advantages
from redline.loop.batching import aggregation_weight, balance_across_ranks, pack, split_by_token_budget
from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.loop.dealt_rollout import rollout_batch
from redline.loop.profiling import StepProfiler
from redline.rollout.types import Sample


@dataclass
class RunState:
    config: object  # RunConfig
    worker: object  # TrainerWorker
    rollout: object  # RolloutManager: async generate(rollout_id) -> (samples, metrics)
    engine: object  # rollout engine
    weight_sync: object  # WeightSync: trainer → engine pushes and the engine's colocated memory
    loss_cfg: object  # redline.kernels.LossConfig
    kl_controller: AdaptiveKLController | None
    loop: asyncio.AbstractEventLoop
    critic: object | None = None  # CriticWorker, for advantage_estimator "ppo"
    dp: DataParallel = SINGLE_PROCESS  # the data-parallel ranks (each one runs this same step on its shard)
    on_phase: Callable[[str], None] = lambda name: None  # told each phase as it starts (the progress display)
    telemetry: GpuTelemetry = field(default_factory=lambda: GpuTelemetry(None))  # perf/gpu_* per step; off: none
    profiler: StepProfiler = field(default_factory=StepProfiler)  # --use-pytorch-profiler; off: inert
    schedule: object = None  # --async-rollout's (redline.loop.async_schedule), installed at construction

    def __post_init__(self):
        from redline.loop.async_schedule import make_schedule

        self.schedule = make_schedule(self)  # an async one wraps ``rollout`` and ``weight_sync``


def enter_phase(state: RunState, phase: str, shown: str | None = None) -> None:
    """Phase ``phase`` (a ``perf/<phase>_time`` name) starts: the progress display shows ``shown`` (if given),
    GPU telemetry and the profiler charge what follows to ``phase``."""
    if shown is not None:
        state.on_phase(shown)
    state.telemetry.phase(phase)
    state.profiler.phase(phase)


def clock() -> float:
    """Seconds, after the device's queued work: each phase is charged its own GPU time."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def per_sample(state: RunState, samples: list[Sample], per_position) -> list[torch.Tensor]:
    """``per_position(batch) -> [T]`` over token-budget micro-batches, cut into one ``[response_length]`` fp32
    tensor per sample."""
    out: list[torch.Tensor] = [None] * len(samples)
    lengths = [len(s.tokens) for s in samples]
    for ids in split_by_token_budget(lengths, state.config.train.max_tokens_per_gpu):
        batch = pack(samples, ids, {})
        for sid, values in zip(ids, batch.response_values(per_position(batch).float().cpu(), samples)):
            out[sid] = values
    return out


def per_sample_logprobs(state: RunState, samples: list[Sample], *, reference: bool) -> list[torch.Tensor]:
    """``[response_length]`` fp32 log-probs of every sample's response under the policy (or reference)."""
    return per_sample(state, samples, lambda batch: state.worker.logprobs(batch, reference=reference)[0])


def global_batch_ids(step: int, global_batch_size: int, per_rank: int, world: int) -> list[int]:
    """Indices into the pooled samples (rank ``r``'s ``per_rank`` samples at ``r · per_rank``) of optimizer step
    ``step``'s global batch: the ``step``-th ``global_batch_size / world`` slice of every rank's samples."""
    size = global_batch_size // world
    return [r * per_rank + i for r in range(world) for i in range(step * size, (step + 1) * size)]


def deal(lengths: list[int], ids: list[int], max_tokens: int, world: int) -> list[list[list[int]]]:
    """One optimizer step's micro-batches per rank: the pooled samples ``ids`` (``lengths`` by pooled index) in
    token-budget micro-batches, dealt out across the ranks by token load; each micro-batch a list of pooled
    indices."""
    step_lengths = [lengths[i] for i in ids]
    per_rank = balance_across_ranks(split_by_token_budget(step_lengths, max_tokens), step_lengths, world)
    return [[[ids[j] for j in group] for group in groups] for groups in per_rank]


def reward_kl_coef(state: RunState) -> float:
    """The KL coefficient in the reward this step: the adaptive controller's, else ``--kl-coef``."""
    return state.kl_controller.coef if state.kl_controller else state.config.algo.kl_coef


def reuses_old_logp(state: RunState) -> bool:
    """Whether the loss takes its old log-probs from its own forward: exact when the weights cannot move between
    the rollout and the loss (one optimizer step per rollout, no KL in the reward)."""
    return state.config.train.num_steps_per_rollout == 1 and reward_kl_coef(state) == 0


def rl_step(state: RunState, rollout_id: int) -> dict[str, float]:
    cfg, algo, dp = state.config, state.config.algo, state.dp
    step_start = clock()
    state.telemetry.begin()

    # 1. rollout: generate n samples per prompt, score them, filter groups (--async-rollout: hand over the ones
    #    generated while the last step trained)
    enter_phase(state, "rollout", "rollout")
    # under TP/PP the model-parallel group's leader generates for its DP rank and hands the group the samples;
    # with --no-colocate under DP > 1 rank 0 generates the whole batch and deals its groups out
    samples, metrics = rollout_batch(state, rollout_id)
    t0 = clock()
    rollout_time = t0 - step_start
    enter_phase(state, "offload_rollout")
    state.loop.run_until_complete(state.weight_sync.release())  # --offload-rollout: the GPU is the trainer's
    offload_time = clock() - t0
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    rollout_logp = [torch.tensor(s.rollout_logp, dtype=torch.float32) for s in samples]
    loss_masks = torch.cat([torch.tensor(s.loss_mask, dtype=torch.bool) for s in samples])

    # 2. old / reference log-probs (old ones are reused when the weights cannot move before the loss sees them,
    #    unless an async batch mixes staleness values: its log-prob gap is then reported per staleness)
    state.schedule.overlap_begin()  # --async-rollout: from here to the push the engines keep generating
    enter_phase(state, "logprob", "log-probs")
    t0 = clock()
    kl_coef = reward_kl_coef(state)
    reuse_old = reuses_old_logp(state) and not state.schedule.mixed_staleness(samples)
    need_ref = state.loss_cfg.kl_coef > 0 or kl_coef > 0
    old_logp = None if reuse_old else per_sample_logprobs(state, samples, reference=False)
    ref_logp = per_sample_logprobs(state, samples, reference=True) if need_ref else None
    old_values = per_sample(state, samples, state.critic.values) if state.critic else None
    logprob_time = clock() - t0

    # 3. advantages (KL in the reward when --kl-coef > 0)
    cu_resp = torch.tensor([0] + [s.response_length for s in samples]).cumsum(0)
    kl = kl_estimate(torch.cat(old_logp) - torch.cat(ref_logp), algo.kl_loss_type) if kl_coef else None
    advantages, returns = compute_advantages(
        algo.advantage_estimator, rewards, torch.tensor([s.group_index for s in samples]), cu_resp, loss_masks,
        kl=kl, kl_coef=kl_coef, normalize_by_std=algo.normalize_advantages_by_std, gamma=algo.gamma,
        lambd=algo.lambd, values=torch.cat(old_values) if old_values else None, sum_over_ranks=dp.sum_tensor)
    split = cu_resp.diff().tolist()
    per_token = {"advantages": list(advantages.split(split)), "rollout_logp": rollout_logp}
    if state.critic:
        per_token.update(old_values=old_values, returns=list(returns.split(split)))
    if old_logp is not None:
        per_token["old_logp"] = old_logp
    if ref_logp is not None and state.loss_cfg.kl_coef > 0:
        per_token["ref_logp"] = ref_logp

    # 4. optimizer steps over global batches of packed micro-batches, dealt out across the data-parallel ranks
    enter_phase(state, "train", "train")
    t0 = clock()
    train_metrics: list[dict[str, float]] = []
    lengths = dp.all_lengths([len(s.tokens) for s in samples])
    schedule = [deal(lengths, global_batch_ids(step, cfg.train.global_batch_size, len(samples), dp.world),
                     cfg.train.max_tokens_per_gpu, dp.world) for step in range(cfg.train.num_steps_per_rollout)]
    needed = [sorted({i for per_rank in schedule for group in per_rank[r] for i in group}) for r in range(dp.world)]
    pool, pool_values = dp.exchange_samples(samples, per_token, needed)
    trained_tokens = 0
    for per_rank in schedule:
        batches = [pack(pool, group, pool_values) for group in per_rank[dp.rank]]
        weights = dp.loss_weights([aggregation_weight(b, state.loss_cfg.agg) for b in batches])
        train_metrics.append(state.worker.step(
            batches, weights,
            # forward: hidden= from the pipeline schedule under PP
            lambda b, **forward: state.worker.policy_loss(b, state.loss_cfg, reuse_old_logp=reuse_old, **forward)))
        if state.critic:
            tokens = dp.loss_weights([aggregation_weight(b, "token-mean") for b in batches])
            train_metrics[-1].update(state.critic.step(batches, tokens))
        trained_tokens += sum(b.num_tokens for b in batches)
        if state.worker.bad_steps > cfg.train.max_bad_steps:
            raise FloatingPointError(f"{state.worker.bad_steps} steps had a NaN/inf loss or gradient "
                                     f"(--max-bad-steps {cfg.train.max_bad_steps}); stopping")
    train_time = clock() - t0
    state.schedule.overlap_end()

    # 5. weight sync: planned buckets into the engine, resuming its memory around them when offloaded
    #    (--async-rollout: every --update-weights-interval steps, when the schedule allows)
    enter_phase(state, "update_weights", "weight sync")
    t0 = clock()
    state.loop.run_until_complete(state.weight_sync.push(str(rollout_id + 1)))
    sync_time = clock() - t0
    metrics.update(state.weight_sync.timings)  # the transition's phases: release, resume weights, sync, ...

    if state.kl_controller and kl is not None:
        kl_sum, kl_tokens, n_samples = dp.sum_tensor(
            torch.tensor([kl[loss_masks].sum(), loss_masks.sum(), len(samples)], dtype=torch.float64)).tolist()
        state.kl_controller.update(kl_sum / max(kl_tokens, 1), int(n_samples))
    step_time = clock() - step_start
    trained = [m for m in train_metrics if not m["skipped"]] or train_metrics
    mean = lambda key: sum(m.get(key, 0.0) for m in trained) / len(trained)
    metrics.update({
        "train/loss": mean("loss"), "train/pg_loss": mean("pg_loss"), "train/kl": mean("kl"),
        "train/entropy": mean("entropy"), "train/clipfrac": mean("clipfrac"), "train/approx_kl": mean("approx_kl"),
        "train/grad_norm": mean("grad_norm"), "train/lr": train_metrics[-1]["lr"],
        "train/skipped_steps": sum(m["skipped"] for m in train_metrics),
        "train/kl_coef": kl_coef,
        "perf/rollout_time": rollout_time, "perf/logprob_time": logprob_time, "perf/train_time": train_time,
        "perf/update_weights_time": sync_time, "perf/offload_rollout_time": offload_time,
        "perf/step_time": step_time,
        "perf/idle_time": step_time - (rollout_time + offload_time + logprob_time + train_time + sync_time),
        "perf/tokens_per_gpu_per_sec": trained_tokens / train_time,
        "perf/train_tflops": 6 * state.worker.num_parameters * trained_tokens / train_time / 1e12,
    })
    if old_logp is not None:
        diffs = torch.cat([(o - r).abs() for o, r in zip(old_logp, rollout_logp)])
        metrics["train/rollout_logprob_abs_diff"] = float(diffs[loss_masks].mean())
    else:
        metrics["train/rollout_logprob_abs_diff"] = mean("rollout_logprob_abs_diff")
    # --async-rollout: staleness, overlap, waits (perf/rollout_time becomes the engines' generating time)
    metrics.update(state.schedule.step_metrics(
        samples, step_start=step_start, step_time=step_time, batch_wait=rollout_time, sync_time=sync_time,
        old_logp=old_logp, rollout_logp=rollout_logp, overall_diff=metrics["train/rollout_logprob_abs_diff"]))
    if state.loss_cfg.tis:
        metrics.update({"train/tis_mean": mean("tis_mean"), "train/tis_clipfrac": mean("tis_clipfrac")})
    if state.critic:
        metrics.update({"train/value_loss": mean("value_loss"), "train/value_clipfrac": mean("value_clipfrac"),
                        "train/value_grad_norm": mean("value_grad_norm")})
    metrics.update(state.telemetry.summary())  # readings of the step's window, taken by the sampler's thread
    return dp.reduce_metrics(metrics)
