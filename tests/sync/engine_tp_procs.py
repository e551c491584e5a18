"""Trainer ranks of colocated engines with several GPUs, for the per-rank payload tests (one process each, gloo)."""

import asyncio
import traceback
from datetime import timedelta

import torch.distributed as dist

from redline.loop.engine_placement import colocated_seat, join_engine_groups
from redline.sync.plan import named_buckets, plan_for
from redline.sync.sglang import gathered_buckets
from sync_export import layer_bytes, qwen3_export


def fake_payload(rank):
    """Stands in for the CUDA-IPC handles of a bucket packed on this rank's GPU: names the rank and the bucket."""
    return lambda bucket: f"rank{rank}:" + ",".join(name for name, _ in bucket)


def gather_every_bucket(rank, world, gpus_per_engine, port, results):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        seat = join_engine_groups(colocated_seat(rank, world, gpus_per_engine), world)
        export = qwen3_export(num_layers=3)
        plan = plan_for(export, bucket_bytes=layer_bytes())

        async def collect():
            return [b.per_rank async for b in gathered_buckets(named_buckets(plan, export), fake_payload(rank),
                                                               seat.group, list(seat.ranks))]

        results.put((rank, (seat.engine, seat.engine_rank, asyncio.run(collect()))))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- any failure goes to the parent, which shows the traceback
        results.put((rank, traceback.format_exc()))
