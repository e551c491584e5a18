"""The start-up kernel warm-up's CPU-checkable parts (``redline.loop.warmup``): its synthetic micro-batches, the
largest micro-batch, the switch, and the compilation clock."""

from types import SimpleNamespace

import pytest
import torch

from redline.loop import warmup
from redline.trainer.parallel import ParallelConfig


def test_synthetic_batch_is_a_packed_micro_batch_of_the_asked_size():
    batch = warmup.synthetic_batch(600, 50, torch.Generator().manual_seed(0), with_ref=True)
    assert batch.input_ids.shape == batch.targets.shape == batch.loss_mask.shape == (600,)
    assert batch.cu_seqlens.tolist() == [0, 256, 512, 600] and batch.cu_seqlens.dtype == torch.int32
    assert batch.sample_ids == [0, 1, 2]
    assert not batch.loss_mask[[0, 256, 512]].any() and int(batch.loss_mask.sum()) == 597
    assert set(batch.token_values) == {"advantages", "old_logp", "rollout_logp", "ref_logp"}
    for values in batch.token_values.values():
        assert values.shape == (600,) and not values[~batch.loss_mask].any()
    assert int(batch.input_ids.max()) < 50


def test_synthetic_batch_of_one_token_still_trains_a_row():
    batch = warmup.synthetic_batch(1, 50, torch.Generator().manual_seed(0), with_ref=False)
    assert batch.loss_mask.tolist() == [True] and "ref_logp" not in batch.token_values


def test_synthetic_batches_leave_the_global_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    warmup.synthetic_batch(300, 50, torch.Generator().manual_seed(0), with_ref=True)
    assert torch.equal(torch.rand(4), expected)


def test_the_largest_micro_batch_is_the_budget_or_one_longer_sample():
    def config(budget, prompt, response):
        return SimpleNamespace(train=SimpleNamespace(max_tokens_per_gpu=budget),
                               data=SimpleNamespace(rollout_max_prompt_len=prompt),
                               rollout=SimpleNamespace(rollout_max_response_len=response))

    assert warmup.max_micro_batch_tokens(config(8192, 16, 128)) == 8192
    assert warmup.max_micro_batch_tokens(config(4096, 1024, 8192)) == 9216
    assert warmup.max_micro_batch_tokens(config(4096, None, 8192)) == 8192


def test_warmup_switch(monkeypatch):
    monkeypatch.delenv(warmup.WARMUP_ENV, raising=False)
    assert warmup.warmup_enabled()
    monkeypatch.setenv(warmup.WARMUP_ENV, "0")
    assert not warmup.warmup_enabled()
    monkeypatch.setenv(warmup.WARMUP_ENV, "no")
    with pytest.raises(ValueError, match=warmup.WARMUP_ENV):
        warmup.warmup_enabled()


def test_compile_clock_sums_tritons_compile_times_and_counts_fresh_compilations(monkeypatch):
    import triton

    heard = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: heard.append(kw["cache_hit"]))
    clock = warmup.CompileClock().install()
    times = SimpleNamespace(ir_initialization=200_000, lowering_stages=[("ttir", 300_000), ("ptx", 400_000)],
                            store_results=100_000)  # µs, as Triton reports them: 1 s in all
    listener = triton.knobs.compilation.listener
    listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=False)
    listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=True)
    assert clock.take() == {"perf/compile_time": pytest.approx(2.0), "perf/compile_count": 1.0}
    assert clock.take() == {"perf/compile_time": 0.0, "perf/compile_count": 0.0}
    assert heard == [False, True]  # a listener already installed still hears every compilation


def test_compile_clock_names_each_kernel_compiled_inside_a_step_with_its_phase(monkeypatch):
    import triton

    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    clock = warmup.CompileClock().install()
    told = []
    on_phase = clock.tracking(told.append)
    times = SimpleNamespace(ir_initialization=250_000, lowering_stages=[], store_results=0)  # 0.25 s
    listener = triton.knobs.compilation.listener
    on_phase("rollout")
    listener(src=SimpleNamespace(name="_decode_kernel"), metadata={}, metadata_group={}, times=times, cache_hit=False)
    on_phase("log-probs")
    listener(src=SimpleNamespace(name="_stats_kernel"), metadata={}, metadata_group={}, times=times, cache_hit=True)
    listener(src=SimpleNamespace(name="_rms_norm_fwd_kernel"), metadata={}, metadata_group={}, times=times,
             cache_hit=False)
    assert told == ["rollout", "log-probs"]  # the progress display still hears every phase
    assert clock.stall_report(1) == ("step 1 compiled 2 Triton kernel(s) the warm-up did not reach: _decode_kernel in "
                                     "rollout (0.25 s), _rms_norm_fwd_kernel in log-probs (0.25 s)")
    clock.take()
    assert clock.stall_report(2) is None  # a cache hit alone is no compilation


def test_a_step_settles_the_compilations_of_every_rank_on_each(monkeypatch):
    """Several processes: each step's compile metrics are the most any rank paid and every rank that compiled gets
    its stall line, named by rank (under PP the LM head's kernels compile on the last stage, not on rank 0, which
    logs); rank 1's part of the gather is stood in for. One process: its own, unchanged."""
    import torch.distributed as dist
    import triton

    from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel

    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    times = SimpleNamespace(ir_initialization=500_000, lowering_stages=[], store_results=0)  # 0.5 s
    clock = warmup.CompileClock().install()
    assert warmup.settle_step(clock, 3, SINGLE_PROCESS) == ({"perf/compile_time": 0.0, "perf/compile_count": 0.0},
                                                            [])
    other = ("step 3 compiled 1 Triton kernel(s) the warm-up did not reach: _stats_kernel in train (2.00 s)",
             {"perf/compile_time": 2.0, "perf/compile_count": 1.0})

    def gather(out, mine):
        out[:] = [mine, other]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    clock.phase = "log-probs"
    triton.knobs.compilation.listener(src=SimpleNamespace(name="_rms_norm_fwd_kernel"), metadata={},
                                      metadata_group={}, times=times, cache_hit=False)
    paid, stalls = warmup.settle_step(clock, 3, DataParallel(rank=0, world=2))
    assert paid == {"perf/compile_time": 2.0, "perf/compile_count": 1.0}
    assert stalls == [("rank 0: step 3 compiled 1 Triton kernel(s) the warm-up did not reach: _rms_norm_fwd_kernel "
                       "in log-probs (0.50 s)"), f"rank 1: {other[0]}"]
    assert clock.take() == {"perf/compile_time": 0.0, "perf/compile_count": 0.0}


def _tiny_state(tmp_path, steps_per_rollout=2, **extra):
    from redline.config import TrainConfig
    from redline.kernels import LossConfig
    from redline.loop.worker import TrainerWorker
    from redline.trainer.models import from_pretrained

    model = from_pretrained(_tiny_model(tmp_path), backend="bf16", dtype=torch.float32)
    worker = TrainerWorker(model, TrainConfig(), total_steps=1, temperature=1.0, keep_reference=False)
    config = SimpleNamespace(train=SimpleNamespace(max_tokens_per_gpu=40, num_steps_per_rollout=steps_per_rollout),
                             data=SimpleNamespace(rollout_max_prompt_len=4),
                             rollout=SimpleNamespace(rollout_max_response_len=8, rollout_batch_size=1,
                                                     n_samples_per_prompt=8), algo=SimpleNamespace(kl_coef=0.0))
    return SimpleNamespace(worker=worker, loss_cfg=LossConfig(), config=config, kl_controller=None,
                           on_phase=lambda name: None, **extra)


@pytest.mark.parametrize("steps_per_rollout", [1, 2])  # the reused-old-logp loss and the fused policy loss
def test_compile_step_kernels_runs_the_step_calls_and_leaves_the_trainer_as_it_was(tmp_path, steps_per_rollout):
    """The warm-up's own path on the CPU (PyTorch kernels): every size runs the log-prob pass and a train
    forward + backward, and afterwards the weights, gradients and optimizer state are those of a fresh trainer."""
    state = _tiny_state(tmp_path, steps_per_rollout)
    worker, model = state.worker, state.worker.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    logprobs, policy_loss = worker.logprobs, worker.policy_loss
    worker.logprobs = lambda batch, **kw: calls.append(("logprobs", batch.num_tokens)) or logprobs(batch, **kw)
    worker.policy_loss = lambda batch, *a, **kw: calls.append(("loss", batch.num_tokens)) or policy_loss(batch, *a,
                                                                                                          **kw)
    phases = []
    state.on_phase = phases.append
    assert warmup.compile_step_kernels(state) == len(warmup.warmup_row_counts(40))
    sizes = warmup.warmup_row_counts(40)
    assert calls == [(kind, n) for n in sizes for kind in ("logprobs", "loss")]
    assert phases[-1] == f"kernel warm-up: micro-batch {len(sizes)}/{len(sizes)} (40 tokens)"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert not worker.optimizer.state


def _tiny_engine(tmp_path, **options):
    from redline.rollout.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_pretrained(_tiny_model(tmp_path), dtype=torch.float32, **options)


def _tiny_model(tmp_path):
    from redline.loop.builtin import tiny_model

    folder = tmp_path / "m"
    return folder if folder.exists() else tiny_model(folder)


class _RecordingEngine:
    """A real engine whose ``generate`` calls are noted as ``(prompts, width, tokens asked)``."""

    def __init__(self, engine, calls):
        self.engine, self.calls = engine, calls

    async def generate(self, requests):
        widths = {len(r.input_ids) for r in requests}
        self.calls.append((len(requests), *widths, requests[0].params.max_new_tokens))
        return await self.engine.generate(requests)


def test_warm_engine_generates_every_prefill_shape_through_the_engine_and_changes_no_later_sample(tmp_path):
    """The embedded engine (on the CPU: PyTorch kernels) generates two tokens for each ``prefill_shapes`` batch of
    the run's engine rows and prompt length; a seeded request afterwards (as every rollout request is) draws what it
    draws on an engine that never warmed up."""
    import asyncio

    from redline.kernels.tuning_buckets import prefill_shapes
    from redline.rollout.types import GenerateRequest, SamplingParams

    warmed, fresh = (_tiny_engine(tmp_path, max_batch_size=24, max_seq_len=32) for _ in range(2))
    calls, phases = [], []
    config = SimpleNamespace(data=SimpleNamespace(rollout_max_prompt_len=16),
                             rollout=SimpleNamespace(rollout_batch_size=3, n_samples_per_prompt=8,
                                                     rollout_max_response_len=8))
    state = SimpleNamespace(config=config, engine=_RecordingEngine(warmed, calls), loop=asyncio.new_event_loop(),
                            on_phase=phases.append)
    request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=6, ignore_eos=True, seed=7))
    try:
        assert warmup.warm_engine(state) == len(prefill_shapes(24, 16)) == 6
        after, never = (state.loop.run_until_complete(e.generate([request]))[0] for e in (warmed, fresh))
    finally:
        for engine in (warmed, fresh):
            state.loop.run_until_complete(engine.shutdown())
        state.loop.close()
    assert calls == [(prompts, width, 2) for prompts, width in prefill_shapes(24, 16)]
    assert phases[-1] == "kernel warm-up: engine batch 6/6 (16 prompts of 1 tokens)"
    assert len(after.output_ids) == 6 and after.output_ids == never.output_ids and after.logp == never.logp


class _EngineMemory:
    """Records the warm-up's calls on the weight sync (``--offload-rollout``)."""

    offload = True

    def __init__(self):
        self.calls = []

    async def release(self):
        self.calls.append("release")

    async def push(self, version):
        self.calls.append(f"push {version}")


def test_warm_up_tunes_on_rank_0_saves_the_table_and_trains_with_the_engine_memory_released(tmp_path, monkeypatch):
    """The orchestration with the GPU queries answered as on an H100 (the LM-head tuning itself has nothing to do
    at this size): the table is written where the start-up line says, the engine's memory is released around the
    synthetic micro-batches and given back at the engine's version, and step 1's metrics carry the cost."""
    import asyncio
    import io

    from rich.console import Console

    from redline.kernels import tuning_table
    from redline.kernels.tuning_buckets import prefill_shapes
    from redline.loop.data_parallel import SINGLE_PROCESS

    fp = _fingerprint()
    monkeypatch.setenv("REDLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning_table, "current_fingerprint", lambda device: fp)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    sync = _EngineMemory()
    engine = _tiny_engine(tmp_path, max_batch_size=8, max_seq_len=16)
    state = _tiny_state(tmp_path, weight_sync=sync, dp=SINGLE_PROCESS, loop=asyncio.new_event_loop(),
                        engine=_RecordingEngine(engine, sync.calls))
    out = io.StringIO()
    metrics = warmup.warm_up(state, Console(file=out, width=300), warmup.CompileClock(), "0")
    state.loop.run_until_complete(engine.shutdown())
    state.loop.close()
    assert sync.calls[:2] == ["release", "push 0"]  # the engine generates only once its memory is back
    assert sync.calls[2:] == [(prompts, width, 2) for prompts, width in prefill_shapes(8, 4)]
    path = tuning_table.table_path(fp)
    assert path.parent == tmp_path / "cache" / "autotune" and tuning_table.load(path, fp) == []
    assert f"kernel tuning table: {path}" in out.getvalue() and "kernel warm-up:" in out.getvalue()
    assert set(metrics) == {"perf/startup_compile_time", "perf/startup_compile_count", "perf/startup_tuned_keys"}
    assert metrics["perf/startup_compile_time"] > 0 and metrics["perf/startup_tuned_keys"] == 0


def _tuning_ranks(tmp_path, tp, pp, dp):
    """Every rank's record of ``dp_procs.warmup_tuning_worker`` over a ``tp × pp × dp`` gloo mesh."""
    import torch.multiprocessing as mp

    from tests.loop.dp_procs import warmup_tuning_worker  # importable by the spawned ranks

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(warmup_tuning_worker, args=(str(tmp_path / "store"), str(tmp_path / "cache"), results, tp, pp, dp),
                 nprocs=tp * pp * dp, join=True)
        return dict(results)


def _one_table(tmp_path):
    from redline.kernels import tuning_table

    tables = list((tmp_path / "cache" / "autotune").iterdir())
    assert len(tables) == 1
    return tables[0], tuning_table.load(tables[0], _fingerprint())


def test_rank_0_tunes_and_the_other_ranks_compile_its_choices_without_timing(tmp_path):
    """Data parallelism: rank 0 times the key and writes the table; rank 1 holds rank 0's choice before it compiles,
    so it times nothing and runs the same config."""
    results = _tuning_ranks(tmp_path, tp=1, pp=1, dp=2)
    first, second = results[0], results[1]
    assert len(first["timed"]) == 1 and second["timed"] == []
    assert first["seen"] == [{}] and list(first["holds"]) == [str(tuple(first["timed"][0]))]
    assert second["seen"] == [first["holds"]] and second["holds"] == first["holds"]
    assert first["metrics"] == second["metrics"] == {"perf/startup_tuned_keys": 1.0}
    path, entries = _one_table(tmp_path)
    assert len(entries) == 1 and f"kernel tuning table: {path}" in first["printed"]


# (tp, pp, dp): TP ranks of the last stage, DP ranks of the last stage
@pytest.mark.parametrize("layout", [
    (2, 2, 1),
    # slow: 30-40 s on 2 shared CPU cores (4 spawned ranks), the same path as tp2-pp2 with DP ranks on the last stage
    pytest.param((1, 2, 2), marks=pytest.mark.slow)], ids=["tp2-pp2", "pp2-dp2"])
def test_under_pipeline_parallelism_the_last_stage_tunes_once_and_every_head_rank_takes_its_choices(tmp_path,
                                                                                                    layout):
    """4 gloo ranks (the run's mesh, TP fastest, then PP, DP outermost): the last stage owns the LM head, so its first
    rank (DP and TP rank 0 of the last stage) alone times the key and writes the table; the last stage's other
    ranks hold its choice before they compile it; the first stage never reads the head nor compiles; every rank
    reports the same metrics and prints the table's line (rank 0's console is the one a run shows)."""
    tp, pp, dp = layout
    results = _tuning_ranks(tmp_path, tp, pp, dp)
    mesh = ParallelConfig(tp=tp, pp=pp, dp=dp)
    last_stage = {mesh.global_rank(d, pp - 1, t) for d in range(dp) for t in range(tp)}
    leader = min(last_stage)
    assert leader == mesh.global_rank(0, pp - 1, 0) and last_stage == ({2, 3} if dp == 1 else {1, 3})
    chosen = results[leader]["holds"]
    assert len(results[leader]["timed"]) == 1 and results[leader]["seen"] == [{}]
    assert list(chosen) == [str(tuple(results[leader]["timed"][0]))]
    for rank, record in results.items():
        assert record["metrics"] == {"perf/startup_tuned_keys": 1.0}, rank
        assert record["read_head"] == (rank in last_stage), rank
        if rank in last_stage - {leader}:  # the leader's choice held before compiling: nothing timed
            assert record["timed"] == [] and record["seen"] == [chosen] and record["holds"] == chosen, rank
        elif rank not in last_stage:
            assert record["timed"] == record["seen"] == [] and record["holds"] == {}, rank
    path, entries = _one_table(tmp_path)
    assert len(entries) == 1 and f"kernel tuning table: {path}" in results[0]["printed"]


def _fingerprint():
    from redline.kernels import tuning_table

    return tuning_table.Fingerprint(device="NVIDIA H100 80GB HBM3", capability=(9, 0), driver="570", cuda="13.0",
                                    triton="3.6.0", torch="2.11.0", redline="0.1.0")


class _Specializations:
    """Stands in for the Triton kernel ``kernel``: notes the specialization Triton would compile each launch under
    (its own ``native_specialize_impl`` over the arguments, honouring the kernel's ``do_not_specialize`` lists, with
    the constexprs) and runs nothing."""

    def __init__(self, kernel):
        options = kernel.kwargs  # the decorator's, kept by the interpreter's stand-in
        self.plain = set(options.get("do_not_specialize") or ())
        self.any_alignment = set(options.get("do_not_specialize_on_alignment") or ())
        self.names = kernel.arg_names
        self.seen = set()

    def __getitem__(self, grid):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        def launch(*args, **constexprs):
            self.seen.add((tuple(native_specialize_impl(CUDABackend, a, False, name not in self.plain,
                                                        name not in self.any_alignment)
                                 for name, a in zip(self.names, args)), tuple(sorted(constexprs.items()))))

        return launch


def test_warm_up_shapes_meet_every_rms_norm_specialization_of_the_1p7b_example(monkeypatch):
    """Qwen3-1.7B's RMSNorms (hidden 2048; q/k norms of 16 and 8 heads of 128 inside the fused QKV output) as the
    trainer runs them on ``[T, H]`` and the engine on ``[prompts, width, H]``: the trainer's warm-up sizes and the
    engine's ``prefill_shapes`` batches (and its decode step over all 128 rows) meet every specialization the
    step's micro-batches (any T up to 8192) and rollouts (up to 128 prompts of up to 16 tokens) meet — and the
    trainer's sizes alone miss the engine's, which is what step 1's rollout compiled before the engine was warmed."""
    from redline.kernels.tuning_buckets import prefill_shapes, warmup_row_counts
    from redline.trainer.layers import rms_norm_triton

    kernel = _Specializations(rms_norm_triton._rms_norm_fwd_kernel)
    monkeypatch.setattr(rms_norm_triton, "_rms_norm_fwd_kernel", kernel)
    hidden, heads, kv_heads, head_dim = 2048, 16, 8, 128
    weights = {n: torch.ones(n, dtype=torch.bfloat16) for n in (hidden, head_dim)}

    def norms(*lead):
        """The specializations of one forward's RMSNorms over tokens shaped ``lead``."""
        kernel.seen = set()
        rms_norm_triton.rms_norm_triton(torch.empty(*lead, hidden, dtype=torch.bfloat16), weights[hidden], 1e-6)
        qkv = torch.empty(*lead, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
        q, k, _ = (t.unflatten(-1, (-1, head_dim)) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                        kv_heads * head_dim], dim=-1))
        for x in (q, k):
            rms_norm_triton.rms_norm_triton(x, weights[head_dim], 1e-6)
        return kernel.seen

    def union(shapes):
        return set().union(*(norms(*lead) for lead in shapes))

    trainer = union((t,) for t in warmup_row_counts(8192))
    engine = union([*((p, w) for p, w in prefill_shapes(128, 16)), (128, 1)])
    step = union((t,) for t in range(1, 8193))
    rollout = union([*((p, w) for p in range(1, 129) for w in range(1, 17))])
    assert step <= trainer
    assert rollout <= trainer | engine
    assert not rollout <= trainer


def test_warm_up_batches_meet_every_log_prob_statistics_specialization_of_the_1p7b_example(monkeypatch):
    """The no-grad log-prob pass at Qwen3-1.7B's head (V = 151936, H = 2048; the GPU's chunk alignment and launch):
    the warm-up's synthetic micro-batches meet every ``_stats_kernel`` specialization that the example's own
    log-prob micro-batches (62 and 4 samples of a 4-token prompt and 128 response tokens) and any selected-row count
    up to the 8192-token budget meet. The GEMMs are skipped: only the shapes matter."""
    from redline.kernels import linear_logprobs_triton as lp
    from redline.kernels.tuning_buckets import warmup_row_counts

    kernel = _Specializations(lp._stats_kernel)
    monkeypatch.setattr(lp, "_stats_kernel", kernel)
    monkeypatch.setattr(lp, "ALIGN", 256)
    monkeypatch.setattr(lp, "STATS_LAUNCH", dict(BLOCK_R=2, BLOCK_V=1024, num_warps=4))
    monkeypatch.setattr(lp, "_mm_into", lambda out, a, b, accumulate=False: None)
    weight = torch.empty(151936, 2048, dtype=torch.bfloat16)

    def stats(n_tokens, rows):
        kernel.seen = set()
        lp.forward_stats(torch.empty(n_tokens, 2048, dtype=torch.bfloat16), weight,
                         torch.zeros(n_tokens, dtype=torch.long), rows, 1.0, 0)
        return kernel.seen

    def example_batch(samples, prompt=4, response=128):
        """Rows in the loss of ``samples`` packed samples, as ``batching.pack`` masks them."""
        length = prompt + response
        rows = [s * length + i for s in range(samples) for i in range(prompt - 1, length - 1)]
        return samples * length, torch.tensor(rows)

    generator = torch.Generator().manual_seed(0)
    warm = set()
    for n in warmup_row_counts(8192):
        mask = warmup.synthetic_batch(n, 10, generator, with_ref=False).loss_mask
        warm |= stats(n, None if mask.all() else mask.nonzero().squeeze(1))
    for samples in (62, 4):
        assert stats(*example_batch(samples)) <= warm, samples
    for selected in range(1, 8193, 61):
        assert stats(selected + 1, torch.arange(selected)) <= warm, selected


@pytest.mark.parametrize("steps_per_rollout", [
    # slow: ~40 s on 2 shared CPU cores (4 spawned ranks); the reused-old-logp loss differs from the fused policy
    # loss only in its LM-head op, which the log-prob pass already runs under TP/PP
    pytest.param(1, marks=pytest.mark.slow),
    2])
def test_under_tp_sp_and_pp_the_warm_up_runs_the_steps_parallel_calls_and_leaves_the_trainer_as_it_was(
        tmp_path, steps_per_rollout):
    """TP=2 + SP × PP=2 over 4 gloo ranks, the whole warm-up on the sharded tiny model: every rank runs a 1F1B
    forward/backward per micro-batch size; only the last stage's TP ranks run the LM head, always vocab-parallel
    over the TP group, on each size's whole (unpadded) stream: a log-prob pass and a train loss per size; the
    group's leader alone generates; weights, the optimizer's master shard and moments are as before and no
    gradient is left (the master's fp32 buffer included)."""
    import torch.multiprocessing as mp

    from redline.kernels.tuning_buckets import prefill_shapes
    from redline.loop.builtin import tiny_model
    from tests.loop.mp_procs import warmup_step_worker  # importable by the spawned ranks

    model = tiny_model(tmp_path / "model", seed=7, vocab_multiple=2)  # TP=2 splits the vocabulary
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(warmup_step_worker, args=(str(tmp_path / "store"), str(model), str(tmp_path / "cache"),
                                           steps_per_rollout, results), nprocs=4, join=True)
        results = dict(results)
    sizes = warmup.warmup_row_counts(16)  # odd sizes among them: SP pads those to a multiple of 2
    loss_kind = "logprobs" if steps_per_rollout == 1 else "policy_loss"  # reused old log-probs: the log-prob op
    last_stage = {2, 3}  # ranks are pp-major, TP fastest
    for rank, record in results.items():
        assert record["schedules"] == len(sizes), rank
        assert record["heads"] == ([head for n in sizes for head in (("logprobs", n, True), (loss_kind, n, True))]
                                   if rank in last_stage else []), rank
        assert record["engine"] == ([prompts for prompts, _ in prefill_shapes(8, 4)] if rank == 0 else []), rank
        assert record["weights"] and record["optimizer"] and record["grads"], rank
        assert record["metrics"] == ["perf/startup_compile_count", "perf/startup_compile_time",
                                     "perf/startup_tuned_keys"]


@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2"])
def test_two_gpus_warm_up_under_tp_and_pp_leaves_no_compilation_to_the_steps(layout, tmp_path, monkeypatch):
    """``redline train`` over NCCL at TP=2 + SP and PP=2 from empty caches, the LM head on the Triton GEMMs (so
    there are keys to tune): the warm-up compiles, one rank tunes (one table; its keys in step 1's record, which
    rank 0 writes even when the last stage tuned), and no step compiles a kernel on any rank."""
    from redline.kernels import tuning_table
    from redline.loop.builtin import tiny_model
    from tests.loop.test_model_parallel import LAYOUTS, train

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (one per rank)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(tuning_table.CACHE_ENV, str(tmp_path / "redline"))
    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "triton")
    processes, flags = LAYOUTS[layout]
    out = tmp_path / "run"
    records = train(out, tiny_model(tmp_path / "model", seed=7, vocab_multiple=2), *flags, "--eval-interval", "0",
                    processes=processes)
    console = (out / "console.log").read_text()
    steps = [r for r in records if r["step"] >= 1]
    assert steps[0]["perf/startup_compile_count"] > 0 and steps[0]["perf/startup_tuned_keys"] > 0
    assert "kernel tuning table:" in console and "kernel warm-up:" in console
    assert len(list((tmp_path / "redline" / "autotune").iterdir())) == 1
    stalls = [line for line in console.splitlines() if "the warm-up did not reach" in line]
    assert [r["perf/compile_count"] for r in steps] == [0.0] * len(steps) and not stalls, stalls
