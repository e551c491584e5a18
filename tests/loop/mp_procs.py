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
