"""A colocated SGLang engine of several GPUs beside a tensor (× pipeline) parallel trainer: every engine TP rank
gets, from the trainer rank on its GPU, the exact bytes of the unsharded model, one request per (bucket, stage)
part, while no rank holds more than two buckets of gathered weights at once (``redline.loop.parallel_sync``:
``full_buckets``, ``seat_parts``). Gloo processes and a stand-in SGLang server on the CPU."""

import multiprocessing as mp

import pytest
from tests.gloo_ranks import run_ranks

from tests.loop import seat_model_parallel_procs  # importable by the spawned ranks

CTX = mp.get_context("spawn")  # not fork: the test process may hold threads (HTTP, gloo) of earlier tests
TIMEOUT_S = 240


def push_on_ranks(tp, pp, dp):
    world = tp * pp * dp
    outcome = run_ranks(CTX, seat_model_parallel_procs.trainer_through_seat, world,
                        lambda rank, port: (rank, world, port, tp, pp), TIMEOUT_S)
    failed = {r: o for r, o in outcome.items() if isinstance(o, str)}
    assert not failed, failed
    return outcome


def received_by_engine_rank(calls, world):
    """``{engine TP rank: {hf_name: hash}}`` from the server's update requests, each rank's payload checked to
    come from the trainer rank on its GPU and no tensor sent twice to one engine rank."""
    updates = [body["serialized_named_tensors"] for path, body in calls if path == "/update_weights_from_tensor"]
    received = {r: {} for r in range(world)}
    for per_rank in updates:
        assert len(per_rank) == world
        for engine_rank, payload in enumerate(per_rank):
            source, items = payload.split(":", 1)
            assert source == f"rank{engine_rank}"  # its own GPU's copy, in engine TP order
            for item in items.split(";"):
                name, digest = item.split("=")
                assert name not in received[engine_rank], f"{name} sent twice to engine rank {engine_rank}"
                received[engine_rank][name] = int(digest)
    return updates, received


@pytest.mark.slow  # gloo processes
@pytest.mark.parametrize("tp,pp,dp,parts", [(2, 1, 1, 5), (2, 2, 1, 6), (2, 1, 2, 5)])
def test_every_engine_rank_gets_the_unsharded_model_holding_at_most_two_buckets(tp, pp, dp, parts):
    """One engine over the whole world: a TP=2 group, a TP=2 x PP=2 group, or two TP=2 data-parallel groups (each
    engine rank served by the group on its GPU)."""
    world = tp * pp * dp
    outcome = push_on_ranks(tp, pp, dp)
    calls, expected, buckets, _, mode, description = outcome[0]
    assert len(buckets) == 5  # the middle bucket holds layers 3 and 4: under PP=2 one part on each stage
    assert all(outcome[r][0] is None and outcome[r][4] == "sglang-tp" for r in range(1, world))
    assert mode == "sglang-tp" and "one request per (bucket, stage)" in description
    updates, received = received_by_engine_rank(calls, world)
    assert len(updates) == parts
    for engine_rank in range(world):
        assert received[engine_rank] == expected  # the exact bytes of the whole trained model
    # a bucket's gathered rows beside its assembled tensors, or its tensors beside the next bucket's rows
    two_buckets = 2 * max(buckets)
    assert two_buckets < sum(buckets) / 2  # far from the whole model
    for rank in range(world):
        peak = outcome[rank][3]
        assert 0 < peak <= two_buckets, (rank, peak, buckets)
