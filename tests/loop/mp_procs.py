"""Rank entry points of the model-parallel tests (spawned processes import them by this module's name)."""

import torch
import torch.distributed as dist


def group_export_worker(rank, store, model_dir, tp, pp, bucket_sizes, results):
    """``tp × pp`` gloo ranks (SP on when ``tp > 1``) shard the model at ``model_dir``; ``results[rank]`` gets what
    each saw, compared against the unsharded model loaded in the same process:

    ``leader``: ``(names in stream order, plan names, largest difference)`` of the group stream (leader only,
    ``None`` elsewhere, with the count of tensors the other ranks yielded); ``buckets``: the largest difference
    of this rank's ``full_buckets`` and how many it yielded; ``logp``: the largest difference of the pipeline's
    vocab-parallel log-probs against one process's."""
    from redline.kernels import fused_linear_logprobs
    from redline.loop.batching import MicroBatch
    from redline.loop.model_parallel import last_stage_outputs, tp_group_of
    from redline.loop.parallel_sync import GroupExport, full_buckets
    from redline.sync.plan import plan_for
    from redline.trainer.models import from_pretrained
    from redline.trainer.parallel import ParallelConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp * pp)
    try:
        state = ParallelConfig(tp=tp, pp=pp, dp=1, sp=tp > 1).build("cpu")
        model = from_pretrained(model_dir, dtype=torch.float32, parallel=state)
        reference = from_pretrained(model_dir, dtype=torch.float32)
        expected = dict(reference.export_hf())

        export, seen = GroupExport(model), {}
        for bucket_bytes in bucket_sizes:
            export.plan = None
            export.plan = plan_for(export.export_hf(), bucket_bytes)
            streamed = [(name, tensor.clone()) for name, tensor in export.export_hf()]
            leader = None
            if state.tp_rank == 0 and state.pp_rank == 0:
                worst = max(float((t - expected[n]).abs().max()) for n, t in streamed)
                leader = ([n for n, _ in streamed], export.plan.names(), worst)
            worst_bucket, count = 0.0, 0
            for _, named in full_buckets(model, export.plan, export.stage_names):
                count += len(named)
                worst_bucket = max([worst_bucket] + [float((t - expected[n]).abs().max()) for n, t in named])
            seen[bucket_bytes] = {"leader": leader, "others_yielded": 0 if leader else len(streamed),
                                  "buckets": (worst_bucket, count), "spanning": _spanning(export)}

        generator = torch.Generator().manual_seed(0)
        tokens = 10  # two sequences of 6 and 4; SP pads them to a multiple of tp
        input_ids = torch.randint(0, reference.spec.vocab_size, (tokens,), generator=generator)
        batch = MicroBatch(input_ids, torch.roll(input_ids, -1), torch.tensor([0, 6, tokens], dtype=torch.int32),
                           torch.ones(tokens, dtype=torch.bool), [0, 1])
        (logp,) = last_stage_outputs(model, batch, lambda hidden: fused_linear_logprobs(
            hidden, model.lm_head_weight(), batch.targets, mask=batch.loss_mask, tp_group=tp_group_of(model))[:1], 1)
        want, _ = fused_linear_logprobs(reference(batch.input_ids, batch.cu_seqlens), reference.lm_head_weight(),
                                        batch.targets, mask=batch.loss_mask)
        results[rank] = {"plans": seen, "logp": float((logp - want).abs().max())}
    finally:
        dist.destroy_process_group()


def _spanning(export) -> int:
    """How many of the plan's buckets hold tensors of more than one pipeline stage."""
    return sum(len({s for s, names in enumerate(export.stage_names) if set(b.names) & names}) > 1
               for b in export.plan.buckets)


def warmup_step_worker(rank, store, model_dir, cache_dir, steps_per_rollout, results):
    """TP=2 + SP × PP=2 over 4 gloo ranks: the whole start-up warm-up (``warmup.warm_up``; the GPU queries answered
    as on an H100, an engine stand-in that notes its batches on the group's leader, None elsewhere) on the
    sharded tiny model. ``results[rank]``: ``heads`` (each LM-head kernel call: its kind, hidden rows and whether
    it got the TP group), ``schedules`` (1F1B passes run), ``engine`` (batches the engine generated), whether
    the weights, the optimizer state (its fp32 master shard and moments) and the gradients are as before."""
    import asyncio
    import io
    import os
    from types import SimpleNamespace

    from rich.console import Console

    from redline.config import TrainConfig
    from redline.kernels import LossConfig, tuning_table
    from redline.loop import warmup
    from redline.loop import worker as worker_module
    from redline.loop.data_parallel import DataParallel, model_parallel_group
    from redline.loop.worker import TrainerWorker
    from redline.trainer.models import from_pretrained
    from redline.trainer.parallel import ParallelConfig
    from redline.trainer.parallel import pipeline as pipeline_module

    os.environ["REDLINE_CACHE_DIR"] = cache_dir
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        state = ParallelConfig(tp=2, pp=2, dp=1, sp=True).build("cpu")
        dp = DataParallel(rank=state.dp_rank, world=1, state=state, mp_group=model_parallel_group(state))
        model = from_pretrained(model_dir, dtype=torch.float32, parallel=state)
        trainer = TrainerWorker(model, TrainConfig(), total_steps=1, temperature=1.0, keep_reference=False, dp=dp)
        heads, schedules, engine_calls = [], [], []

        def spy(kind, function):
            def call(hidden, *args, **kwargs):
                heads.append((kind, hidden.shape[0], kwargs.get("tp_group") is state.tp_group))
                return function(hidden, *args, **kwargs)
            return call

        worker_module.fused_linear_logprobs = spy("logprobs", worker_module.fused_linear_logprobs)
        worker_module.fused_linear_policy_loss = spy("policy_loss", worker_module.fused_linear_policy_loss)
        schedule = pipeline_module.one_f_one_b
        pipeline_module.one_f_one_b = lambda *args: schedules.append(1) or schedule(*args)
        fp = tuning_table.Fingerprint(device="NVIDIA H100 80GB HBM3", capability=(9, 0), driver="570",
                                      cuda="13.0", triton="3.6.0", torch="2.11.0", redline="0.1.0")
        tuning_table.current_fingerprint = lambda device: fp
        torch.cuda.get_device_capability = lambda device=None: (9, 0)

        class Engine:
            async def generate(self, requests):
                engine_calls.append(len(requests))
                return []

        config = SimpleNamespace(train=SimpleNamespace(max_tokens_per_gpu=16, num_steps_per_rollout=steps_per_rollout),
                                 data=SimpleNamespace(rollout_max_prompt_len=4),
                                 rollout=SimpleNamespace(rollout_max_response_len=8, rollout_batch_size=1,
                                                         n_samples_per_prompt=8), algo=SimpleNamespace(kl_coef=0.0))
        run = SimpleNamespace(worker=trainer, loss_cfg=LossConfig(), config=config, kl_controller=None, dp=dp,
                              on_phase=lambda name: None, weight_sync=SimpleNamespace(offload=False),
                              engine=Engine() if dp.holds_engine else None, loop=asyncio.new_event_loop())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = {k: v.clone() for k, v in _tensors(trainer.state_dict())}
        metrics = warmup.warm_up(run, Console(file=io.StringIO(), width=300), warmup.CompileClock(), "0")
        run.loop.close()
        results[rank] = {
            "heads": heads, "schedules": len(schedules), "engine": engine_calls, "metrics": sorted(metrics),
            "weights": all(torch.equal(weights[k], v) for k, v in model.state_dict().items()),
            "optimizer": all(torch.equal(optimizer[k], v) for k, v in _tensors(trainer.state_dict())),
            "grads": all(p.grad is None for p in model.parameters())
            and all(not group.main_grad.any() for group in trainer.master.groups)}
    finally:
        dist.destroy_process_group()


def _tensors(tree, prefix=""):
    """``(path, tensor)`` of every tensor in a nested state dict."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}/{i}")
