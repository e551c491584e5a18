"""An SGLang engine of one GPU beside a tensor-parallel trainer (``--rollout-num-gpus-per-engine 1``): only the
group's leader talks to the server, every other rank joins the gathers of each read of the export. How often a
push reads it depends on the server (a checked load: once; flattened buckets and ``/weights_checker``: twice), so
the leader tells the group per push. Gloo processes and a stand-in SGLang server on the CPU."""

import multiprocessing as mp

import pytest
from tests.gloo_ranks import run_ranks

from tests.loop import seat_model_parallel_procs  # importable by the spawned ranks

CTX = mp.get_context("spawn")
TIMEOUT_S = 180


@pytest.mark.slow  # gloo processes
@pytest.mark.parametrize("checked", [True, False], ids=["checked-load", "weights-checker"])
def test_a_tp_group_pushes_into_a_one_gpu_engine_whichever_way_it_checks(checked):
    outcome = run_ranks(CTX, seat_model_parallel_procs.trainer_beside_one_gpu_engine, 2,
                        lambda rank, port: (rank, 2, port, checked), TIMEOUT_S)
    failed = {r: o for r, o in outcome.items() if isinstance(o, str)}
    assert not failed, failed
    (mode, paths, holds), (other_mode, other_paths, _) = outcome[0], outcome[1]
    assert (mode, other_mode, other_paths) == ("sglang", "contributor", None)
    updates = paths.count("/update_weights_from_tensor")
    assert updates == 5  # one request per bucket
    if checked:
        assert "/weights_checker" not in paths and holds is True
    else:
        assert paths.count("/weights_checker") == 1
