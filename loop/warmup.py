"""Start-up kernel warm-up: every Triton kernel an RL step reaches is tuned and compiled before the first step.

Two kinds of first-call cost (measured on an H100 before this warm-up: step 1's train phase 8.5–10.3 s against
0.55–0.73 s steady, and a 5.6 s stall at step 6 when new shapes arrived):
  * autotuning — the LM head's Triton GEMMs time their configs once per tuning key (``redline.kernels.
    lm_head_tuning``). The first rank that runs the LM head (rank 0; under pipeline parallelism DP and TP rank 0
    of the last stage, which owns the head: ``model_parallel.lm_head_leader``) tunes every key the run can reach,
    persists the choices (``redline.kernels.tuning_table``, printed at start-up) and hands them to the other
    ranks; each one that runs the LM head (every DP rank's, every TP rank's: a vocab shard has the same shape on
    each) seeds its autotuners with them, an earlier pipeline stage skips the head. Every rank runs the same
    configs and none waits in a step on another's tuning;
  * JIT compilation — each ``@triton.jit`` kernel (LM-head epilogues, policy loss, scale, RMSNorm, SwiGLU)
    compiles once per specialization of its integer arguments. The trainer runs the step's own calls — the
    log-prob pass, the policy loss forward and backward — on synthetic micro-batches of ``warmup_row_counts`` sizes
    (every power-of-two bucket up to the largest micro-batch, in each integer class). Gradients are dropped and no
    optimizer step is taken. Under TP/SP/PP these are the step's parallel calls on every rank of the group (the
    vocab-parallel head over the TP group, SP's padded streams, the log-prob pass stage to stage and a 1F1B
    forward/backward), so each stage compiles its own layers at the shapes the step gives them (SP: ``T / tp``
    rows between stages) rather than on hidden states made up per stage. The rollout engine, on the ranks that
    hold one (under TP/PP the group's leader), then generates two tokens for each ``prefill_shapes`` batch, so
    the engine's own specializations (RMSNorm over a prefill's ``[prompts, width, H]`` and a decode step's
    ``[rows, 1, H]``, the decode attention) compile here rather than in step 1's rollout (H100, 1.7B example, empty
    caches, before this: step 1 compiled 3 kernels in 1.0 s and its rollout took 3.3 s against 1.0–1.3 s).
    Compiled kernels land in Triton's cache (``TRITON_CACHE_DIR``), so a second run on the machine loads them
    instead.
Run by ``redline train`` on CUDA. On the CPU the kernels run in PyTorch (Triton's interpreter only under tests),
so there is nothing to warm. ``CompileClock`` charges each step the compilation it still pays
(``perf/compile_time``) and names each kernel compiled inside a step with the phase it fell in.
"""

import time
from collections.abc import Callable

import torch

from redline.kernels.tuning_buckets import prefill_shapes, warmup_row_counts
from redline.loop.batching import MicroBatch
from redline.loop.gradients import weighted_backward
from redline.loop.model_parallel import holds_lm_head, lm_head_leader
from redline.loop.rollout_setup import engine_rows
from redline.loop.step import reuses_old_logp
from redline.loop.train_offload import ensure_resident
from redline.rollout.types import GenerateRequest, SamplingParams
from redline.switches import env_switch

WARMUP_ENV = "REDLINE_KERNEL_WARMUP"  # "0": skip the warm-up (first calls then tune and compile inside steps)
SEQUENCE = 256  # tokens per synthetic sequence (the last one of a micro-batch shorter)
ENGINE_TOKENS = 2  # per warm-up prompt: the prefill samples the first, a decode step the second


def warmup_enabled() -> bool:
    """False when ``REDLINE_KERNEL_WARMUP=0``; any other value but 1 is an error naming the variable."""
    return env_switch(WARMUP_ENV)


class CompileClock:
    """Seconds and count of Triton compilations since the last ``take`` (Triton's compilation listener; cache
    hits count their load time), and each kernel compiled with the phase it fell in (``tracking``). One per
    process; ``install`` once."""

    def __init__(self):
        self.seconds, self.count = 0.0, 0
        self.phase = "start-up"
        self.compiled: list[tuple[str, str, float]] = []  # (kernel, phase, seconds) since the last take

    def tracking(self, on_phase: Callable[[str], None]) -> Callable[[str], None]:
        """``on_phase`` that first notes the phase, so a compilation is charged to the phase it happened in."""

        def announce(name: str) -> None:
            self.phase = name
            on_phase(name)

        return announce

    def install(self) -> "CompileClock":
        import triton

        previous = triton.knobs.compilation.listener

        def listen(*, src, metadata, metadata_group, times, cache_hit):
            micros = times.ir_initialization + sum(d for _, d in times.lowering_stages) + times.store_results
            self.seconds += micros / 1e6
            self.count += not cache_hit
            if not cache_hit:
                self.compiled.append((getattr(src, "name", "?"), self.phase, micros / 1e6))
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        triton.knobs.compilation.listener = listen
        return self

    def take(self) -> dict[str, float]:
        """``perf/compile_time`` (s) and ``perf/compile_count`` (kernels compiled, not loaded) since the last call."""
        paid = {"perf/compile_time": self.seconds, "perf/compile_count": float(self.count)}
        self.seconds, self.count, self.compiled = 0.0, 0, []
        return paid

    def stall_report(self, step: int) -> str | None:
        """A line naming each kernel compiled since the last ``take`` with its phase and seconds (None: none was):
        what the warm-up still misses."""
        if not self.compiled:
            return None
        kernels = ", ".join(f"{name} in {phase} ({seconds:.2f} s)" for name, phase, seconds in self.compiled)
        return f"step {step} compiled {len(self.compiled)} Triton kernel(s) the warm-up did not reach: {kernels}"


def settle_step(clock: CompileClock, step: int, dp) -> tuple[dict[str, float], list[str]]:
    """``clock.take()`` and ``clock.stall_report(step)`` over every process of the run (all of them call; ``dp``:
    the run's ``DataParallel``): ``perf/compile_time`` and ``perf/compile_count`` the most any process paid, and
    a stall line for each process that compiled (its rank named when there are several), so rank 0, which logs and
    prints, reports a stall on any rank (under PP the LM head's kernels run on the last stage only)."""
    mine = (clock.stall_report(step), clock.take())
    if dp.processes == 1:
        return mine[1], [mine[0]] if mine[0] else []
    import torch.distributed as dist

    everyone = [None] * dp.processes
    dist.all_gather_object(everyone, mine)
    paid = {key: max(taken[key] for _, taken in everyone) for key in mine[1]}
    return paid, [f"rank {rank}: {report}" for rank, (report, _) in enumerate(everyone) if report]


def synthetic_batch(n_tokens: int, vocab: int, generator: torch.Generator, with_ref: bool) -> MicroBatch:
    """A packed micro-batch of ``n_tokens`` token ids below ``vocab`` in ``SEQUENCE``-token sequences, every
    position but each sequence's first in the loss, with the per-token values a policy loss reads."""
    lengths = [min(SEQUENCE, n_tokens - s) for s in range(0, n_tokens, SEQUENCE)]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    mask = torch.ones(n_tokens, dtype=torch.bool)
    mask[cu[:-1].long()] = n_tokens == 1  # a lone token is still trained on: the kernels see one row
    ids = torch.randint(0, vocab, (n_tokens,), generator=generator)
    values = {"advantages": torch.randn(n_tokens, generator=generator)}
    for name in ("old_logp", "rollout_logp") + (("ref_logp",) if with_ref else ()):
        values[name] = -torch.rand(n_tokens, generator=generator)
    return MicroBatch(input_ids=ids, targets=torch.roll(ids, -1), cu_seqlens=cu, loss_mask=mask,
                      sample_ids=list(range(len(lengths))),
                      token_values={k: v * mask for k, v in values.items()})


def max_micro_batch_tokens(config) -> int:
    """The most tokens one micro-batch can hold: the token budget, or one sample longer than it."""
    longest_sample = (config.data.rollout_max_prompt_len or 0) + config.rollout.rollout_max_response_len
    return max(config.train.max_tokens_per_gpu, longest_sample)


def tune_lm_head(state, console) -> dict[str, float]:
    """Tune the LM-head GEMM choices once, on the first rank that runs the LM head (``lm_head_leader``: rank 0, or
    the last pipeline stage's first rank), and hand them to every rank; each other rank that runs the LM head seeds
    its autotuners with them and compiles them, a rank without it (an earlier pipeline stage) skips both. Returns
    start-up metrics, the same on every rank."""
    from redline.kernels import lm_head_tuning, tuning_table

    worker, dp = state.worker, state.dp
    runs_head = holds_lm_head(worker.model)
    if runs_head:
        weight = worker.model.lm_head_weight().detach()  # this rank's vocab shard: the same shape on each TP rank
        shapes = lm_head_tuning.reachable(max_micro_batch_tokens(state.config), weight.shape[0], weight.shape[1],
                                          weight.dtype, torch.cuda.get_device_capability(weight.device))

    def tune_on_leader():
        fp = tuning_table.current_fingerprint(weight.device)
        path = tuning_table.table_path(fp)
        loaded = tuning_table.apply(lm_head_tuning.AUTOTUNED, tuning_table.load(path, fp))
        lm_head_tuning.tune(weight, shapes, lambda done, total, text: state.on_phase(
            f"kernel warm-up: tuning LM-head GEMM shape {done + 1}/{total} ({text})"))
        entries = tuning_table.harvest(lm_head_tuning.AUTOTUNED)
        tuning_table.save(path, fp, entries)
        blocks = sum(len(b) for keys in shapes.values() for b in keys.values())
        return entries, len(entries) - loaded, (f"kernel tuning table: {path} ({loaded} choices loaded; {blocks} "
                                                f"LM-head GEMM shapes checked)")

    leader = lm_head_leader(worker.model)
    entries, tuned, line = dp.from_rank(tune_on_leader, leader)  # rank 0 prints, whichever rank tuned
    console.print(line, highlight=False)
    if runs_head and dp.process_rank != leader:  # the leader's choices, then this rank's compilations (no timing)
        tuning_table.apply(lm_head_tuning.AUTOTUNED, entries)
        lm_head_tuning.tune(weight, shapes)
    return {"perf/startup_tuned_keys": float(tuned)}


def compile_step_kernels(state) -> int:
    """Run the step's log-prob and train calls on synthetic micro-batches of every ``warmup_row_counts`` size;
    gradients dropped, weights and optimizer state untouched; each size is announced to ``state.on_phase`` (the
    live progress display). The calls are the step's own under TP/SP/PP too: the log-prob pass stage to stage
    (``last_stage_outputs``), the policy loss forward + backward through ``weighted_backward`` (the 1F1B schedule
    under PP), the LM head vocab-parallel over the TP group, SP's padding. Every rank of a model-parallel group
    must call it (its passes are collectives); the batches are the same on each (a fixed seed, the whole vocab).
    Returns the number of sizes run."""
    worker, loss_cfg, cfg = state.worker, state.loss_cfg, state.config
    reuse_old = reuses_old_logp(state)  # the loss path the step takes, so the step compiles nothing new
    counts = warmup_row_counts(max_micro_batch_tokens(cfg))
    generator = torch.Generator().manual_seed(0)  # the run's own random streams stay untouched
    vocab = worker.model.spec.vocab_size  # every rank's, with or without the LM head or a vocab shard

    def loss_fn(batch, **forward):  # forward: hidden= from the pipeline schedule under PP
        return worker.policy_loss(batch, loss_cfg, reuse_old_logp=reuse_old, **forward)

    for i, n in enumerate(counts):
        state.on_phase(f"kernel warm-up: micro-batch {i + 1}/{len(counts)} ({n} tokens)")
        batch = synthetic_batch(n, vocab, generator, with_ref=loss_cfg.kl_coef > 0)
        worker.logprobs(batch)
        worker.model.train()
        # a weight other than 1, as a weighted micro-batch has
        weighted_backward(worker.model, [batch], [0.5], loss_fn, device=worker.device)
        worker.optimizer.zero_grad(set_to_none=True)
    if hasattr(worker.optimizer, "warm_up"):  # the mixed-precision update's kernel (the critic's is the same)
        worker.optimizer.warm_up()
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    return len(counts)


def warm_engine(state) -> int:
    """Generate ``ENGINE_TOKENS`` tokens through the rollout engine for each ``prefill_shapes`` batch (token-0
    prompts up to the run's longest prompt, at most the engine's rows), so the engine's kernels compile now. The
    draws are seeded, as the run's own requests are (``rollout_setup.seeded``): what the run samples does not
    depend on the warm-up. Needs the engine's memory in place. Returns the number of batches."""
    cfg = state.config
    widest = min(cfg.data.rollout_max_prompt_len or 17, 17)  # 17 tokens meet every width class
    params = SamplingParams(max_new_tokens=min(ENGINE_TOKENS, cfg.rollout.rollout_max_response_len), ignore_eos=True,
                            seed=0)
    shapes = prefill_shapes(engine_rows(cfg), widest)
    for i, (prompts, width) in enumerate(shapes):
        state.on_phase(f"kernel warm-up: engine batch {i + 1}/{len(shapes)} ({prompts} prompts of {width} tokens)")
        state.loop.run_until_complete(state.engine.generate([GenerateRequest([0] * width, params)
                                                             for _ in range(prompts)]))
    return len(shapes)


def warm_up(state, console, clock: CompileClock, version: str) -> dict[str, float]:
    """Tune and compile before the first step (CUDA only; every rank of the run calls it, under TP/PP too: its
    passes are the group's collectives); prints a start-up line and returns the metrics step 1 carries:
    ``perf/startup_compile_time`` (s, the warm-up's wall time: tuning, compilation, the synthetic
    micro-batches, the engine batches), ``perf/startup_compile_count`` (kernels compiled rather than loaded from
    Triton's cache), ``perf/startup_tuned_keys`` (autotuner keys timed now). ``version``: the weight version the
    engine holds (``"0"``, or the resumed rollout's), republished when the warm-up gives the engine its memory
    back."""
    began = time.perf_counter()
    clock.take()
    # with --offload-rollout a step trains while the engine's memory is released: the warm-up does too, then gives
    # it back through the step's own push (the same weights, the same version), which also compiles the weight
    # sync's kernels
    offload = getattr(state.weight_sync, "offload", False)
    if offload:
        state.loop.run_until_complete(state.weight_sync.release())
    ensure_resident(state)  # --offload-train: a resumed run's push paused the trainer
    console.print(f"kernel warm-up: tuning the LM-head GEMMs, then the step's kernels at "
                  f"{len(warmup_row_counts(max_micro_batch_tokens(state.config)))} micro-batch sizes and the rollout "
                  f"engine's", highlight=False)
    metrics = tune_lm_head(state, console)
    sizes = compile_step_kernels(state)
    if offload:  # every rank of a model-parallel group takes part in the push
        state.loop.run_until_complete(state.weight_sync.push(version))
    # under TP/PP its group's leader's engine; with --no-colocate under DP > 1 rank 0's alone
    batches = warm_engine(state) if state.engine is not None else 0
    paid = clock.take()
    metrics.update({"perf/startup_compile_time": time.perf_counter() - began,
                    "perf/startup_compile_count": paid["perf/compile_count"]})
    import triton

    console.print(f"kernel warm-up: {metrics['perf/startup_compile_time']:.1f} s — "
                  f"{int(metrics['perf/startup_tuned_keys'])} LM-head GEMM keys tuned, {sizes} micro-batch sizes "
                  f"and {batches} engine batches run, {int(paid['perf/compile_count'])} kernels compiled "
                  f"({paid['perf/compile_time']:.1f} s; Triton cache {triton.knobs.cache.dir})", highlight=False)
    return metrics
