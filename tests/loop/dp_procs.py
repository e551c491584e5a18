"""Rank entry points for the data-parallel tests (spawned processes import them by this module's name)."""

import torch
import torch.distributed as dist

from redline.loop.data_parallel import DataParallel


def exchange_worker(rank, store, results):
    """Two gloo ranks with three samples each exchange what the other trains on; ``results[rank]`` gets
    ``(pool, values)`` with the values as lists."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        samples = [f"r{rank}s{i}" for i in range(3)]  # pooled indices 3·rank + i
        values = {"adv": [torch.full((2,), 10.0 * rank + i) for i in range(3)]}
        needed = [[0, 4, 5], [1, 2, 3]]  # rank 0 trains on one own and two of rank 1's samples, and vice versa
        pool, pool_values = DataParallel(rank=rank, world=2).exchange_samples(samples, values, needed)
        results[rank] = (pool, {k: {i: v.tolist() for i, v in d.items()} for k, d in pool_values.items()})
    finally:
        dist.destroy_process_group()


def reduce_metrics_worker(rank, store, results):
    """Two gloo ranks reduce a step record with the same keys, then one whose keys differ; ``results[rank]`` gets
    the reduced record and the error the second reduction raised (its message, or None)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        dp = DataParallel(rank=rank, world=2)
        same = dp.reduce_metrics({"train/loss": 1.0 + 2 * rank, "perf/train_time": 3.0 + rank})
        try:
            dp.reduce_metrics({"train/loss": 1.0, ("perf/gpu_util/offload_rollout" if rank else "perf/sync_time"): 0.5})
            error = None
        except RuntimeError as exc:
            error = str(exc)
        results[rank] = (same, error)
    finally:
        dist.destroy_process_group()


def warmup_tuning_worker(rank, store, cache_dir, results, tp=1, pp=1, dp=2):
    """``tp × pp × dp`` gloo ranks (the run's mesh, as under torchrun) run the warm-up's LM-head tuning with the GPU
    parts stood in for: ``results[rank]`` gets ``timed`` (keys this rank timed), ``seen`` (the autotuner cache it
    held each time it compiled), ``holds`` (its autotuner cache at the end), ``metrics``, ``read_head`` (whether it
    read the LM-head weight) and ``printed`` (its console output)."""
    import io
    import os
    from types import SimpleNamespace

    from rich.console import Console

    from redline.kernels import lm_head_tuning, tuning_table
    from redline.loop import warmup
    from redline.loop.data_parallel import model_parallel_group
    from redline.trainer.parallel import ParallelConfig

    os.environ["REDLINE_CACHE_DIR"] = cache_dir
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp * pp * dp)
    try:
        state = ParallelConfig(tp=tp, pp=pp, dp=dp).build("cpu")
        fp = tuning_table.Fingerprint(device="NVIDIA H100 80GB HBM3", capability=(9, 0), driver="570",
                                      cuda="13.0", triton="3.6.0", torch="2.11.0", redline="0.1.0")
        kernel = lm_head_tuning.AUTOTUNED["gemm_dz"]
        kernel.cache.clear()
        timed, seen, reads = [], [], []
        key = (32768, 8192, 2048, "torch.int64", "torch.float32")

        def tune(weight, shapes, progress=None):  # what the autotuner does on a GPU: time unknown keys, compile
            seen.append(dict(kernel.cache))
            if key not in kernel.cache:
                timed.append(key)
                kernel.cache[key] = kernel.configs[0]
            return 1

        tuning_table.current_fingerprint = lambda device: fp
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
        lm_head_tuning.reachable = lambda *args: {"gemm_dz": {(32768, 8192): [(18550, 4480)]}}
        lm_head_tuning.tune = tune
        # a pipeline stage's model carries its ParallelState as pp_state (trainer.parallel.split_stage)
        model = SimpleNamespace(lm_head_weight=lambda: reads.append(True) or torch.zeros(8, 4),
                                pp_state=state if pp > 1 else None)
        config = SimpleNamespace(train=SimpleNamespace(max_tokens_per_gpu=32768),
                                 data=SimpleNamespace(rollout_max_prompt_len=None),
                                 rollout=SimpleNamespace(rollout_max_response_len=8))
        group = DataParallel(rank=state.dp_rank, world=dp, state=state,
                             mp_group=model_parallel_group(state) if tp * pp > 1 else None)
        run = SimpleNamespace(worker=SimpleNamespace(model=model), dp=group, config=config,
                              on_phase=lambda name: None)
        out = io.StringIO()
        metrics = warmup.tune_lm_head(run, Console(file=out, width=300))
        def readable(cache):
            return {str(k): str(v) for k, v in cache.items()}

        results[rank] = {"timed": timed, "seen": [readable(c) for c in seen], "holds": readable(kernel.cache),
                         "metrics": metrics, "read_head": bool(reads), "printed": out.getvalue()}
    finally:
        dist.destroy_process_group()
