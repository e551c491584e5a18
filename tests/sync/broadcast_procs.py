"""Ranks of a gloo weight-update group for the broadcast tests (one process each)."""

import traceback

import torch

from redline.sync.broadcast import BroadcastReceiver, BroadcastSender, init_weight_update_group
from redline.sync.plan import plan_for
from redline.sync.receiver import TargetLoader
from sync_export import layer_bytes, qwen3_export

GROUP = "redline-weights-pp0"


def run_rank(rank, world_size, port, syncs, targets, corrupt_rank, results):
    try:
        group = init_weight_update_group("127.0.0.1", port, rank, world_size, GROUP, backend="gloo")
        plan = plan_for(qwen3_export(num_layers=3), bucket_bytes=layer_bytes(), tie_word_embeddings=True)
        # one sender / receiver for all syncs: their buffers are allocated once and reused
        if rank == 0:
            sender = BroadcastSender(group, plan, torch.device("cpu"))
        else:
            receiver = BroadcastReceiver(group, plan, torch.device("cpu"))
            loader = TargetLoader(targets, aliases=plan.aliases)

            def corrupting_load(views):
                loader(views)
                views[0][1].view(-1)[0] += 1  # this receiver's buffer no longer holds the sent bytes

        for step in range(syncs):
            if rank == 0:
                sender.sync(qwen3_export(num_layers=3, seed=step))
            else:
                receiver.sync(corrupting_load if rank == corrupt_rank else loader)
        results.put((rank, "ok"))
    except Exception:
        results.put((rank, traceback.format_exc()))
