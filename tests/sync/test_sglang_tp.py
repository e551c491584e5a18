"""Colocated SGLang engines of several GPUs (``--rollout-num-gpus-per-engine``): slime's per-rank
``update_weights_from_tensor`` lists, assembled over gloo from fake CUDA-IPC payloads (CPU, one process a rank)."""

import multiprocessing as mp

import pytest
import engine_tp_procs
from sync_export import layer_bytes, qwen3_export

from tests.gloo_ranks import run_ranks
from redline.sync.plan import named_buckets, plan_for
from redline.sync.sglang import gather_rank_payloads

CTX = mp.get_context("spawn")  # not fork: the test process may hold threads (HTTP, gloo) of earlier tests
TIMEOUT_S = 120


def gather_on_ranks(world, gpus_per_engine):
    outcome = run_ranks(CTX, engine_tp_procs.gather_every_bucket, world,
                        lambda rank, port: (rank, world, gpus_per_engine, port), TIMEOUT_S)
    failed = {r: o for r, o in outcome.items() if isinstance(o, str)}
    assert not failed, failed
    return outcome


def expected_names():
    export = qwen3_export(num_layers=3)
    plan = plan_for(export, bucket_bytes=layer_bytes())
    return [",".join(name for name, _ in bucket) for bucket in named_buckets(plan, export)]


@pytest.mark.slow  # four processes and a gloo world
def test_each_engine_leader_gets_one_payload_per_engine_tp_rank_in_rank_order():
    outcome = gather_on_ranks(world=4, gpus_per_engine=2)
    buckets = expected_names()
    assert len(buckets) > 2
    # engine 0 on ranks 0, 1; engine 1 on ranks 2, 3: the leader's list for bucket k is [its own, the next rank's]
    for leader, engine in ((0, 0), (2, 1)):
        assert outcome[leader][:2] == (engine, 0)
        assert outcome[leader][2] == [(f"rank{leader}:{b}", f"rank{leader + 1}:{b}") for b in buckets]
    for member, engine in ((1, 0), (3, 1)):
        assert outcome[member] == (engine, 1, [])  # its payloads went to the leader


@pytest.mark.slow
def test_a_single_engine_over_three_ranks_orders_three_payloads():
    outcome = gather_on_ranks(world=3, gpus_per_engine=3)
    assert outcome[0][2] == [tuple(f"rank{r}:{b}" for r in range(3)) for b in expected_names()]
    assert outcome[1][2] == outcome[2][2] == []


def test_engine_ranks_out_of_tp_order_are_refused():
    with pytest.raises(ValueError, match=r"engine_ranks \[3, 2\] must be in engine TP order"):
        gather_rank_payloads("payload", group=None, engine_ranks=[3, 2])
