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
