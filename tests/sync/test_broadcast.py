"""Disaggregated broadcast over a gloo weight-update group built the SGLang way (PrefixStore), on CPU."""

import multiprocessing as mp

import pytest
import torch
import broadcast_procs
import sync_procs
from sync_export import qwen3_export

from tests.gloo_ranks import run_ranks
from redline.sync.broadcast import rank_offsets, stage_group_name

CTX = mp.get_context("fork")  # CPU-only ranks; fork skips re-importing torch
TIMEOUT_S = 120


def run_group(world_size, syncs, targets, corrupt_rank=-1):
    return run_ranks(CTX, broadcast_procs.run_rank, world_size,
                     lambda rank, port: (rank, world_size, port, syncs, targets[rank], corrupt_rank), TIMEOUT_S)


def test_every_receiver_ends_with_the_last_syncs_weights():
    export = qwen3_export(num_layers=3)
    targets = [None] + [sync_procs.shared_zeros_like(export) for _ in range(2)]
    outcome = run_group(3, syncs=3, targets=targets)
    assert outcome == {0: "ok", 1: "ok", 2: "ok"}
    last = dict(qwen3_export(num_layers=3, seed=2))
    for rank in (1, 2):
        for name, tensor in targets[rank].items():
            source = "model.embed_tokens.weight" if name == "lm_head.weight" else name  # tied in the plan
            assert torch.equal(tensor, last[source]), (rank, name)


def test_a_receiver_reading_other_bytes_fails_the_sync_on_every_rank():
    export = qwen3_export(num_layers=3)
    targets = [None] + [sync_procs.shared_zeros_like(export) for _ in range(2)]
    outcome = run_group(3, syncs=1, targets=targets, corrupt_rank=2)
    assert all("ChecksumMismatch" in outcome[rank] for rank in range(3))


def test_rank_offsets_follow_slimes_layout():
    assert rank_offsets([2, 2, 4]) == ([1, 3, 5], 9)


def test_rank_offsets_reject_an_engine_without_gpus():
    with pytest.raises(ValueError, match="at least one GPU"):
        rank_offsets([2, 0])


def test_stage_groups_have_distinct_names():
    assert stage_group_name(0) != stage_group_name(1)


def test_the_group_builds_under_torchruns_agent_store(monkeypatch):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True, inherited by every child) the trainer still serves the
    group's store: a TP/PP trainer's leader sends from inside a torchrun launch (``--no-colocate``)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    export = qwen3_export(num_layers=3)
    outcome = run_group(2, syncs=1, targets=[None, sync_procs.shared_zeros_like(export)])
    assert outcome == {0: "ok", 1: "ok"}
