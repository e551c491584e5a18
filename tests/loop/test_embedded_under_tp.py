"""The embedded engine beside a tensor- or pipeline-parallel trainer runs unsharded: each rank's engine holds the
whole model and a push gives it the full tensors the trainer's export gathers (TP) or broadcasts (PP). Two gloo
ranks on the CPU, both in-process sync modes."""

import multiprocessing as mp

import pytest

from tests.gloo_ranks import run_ranks

from tests.loop import engine_seat_procs  # importable by the spawned ranks

CTX = mp.get_context("spawn")  # not fork: the test process may hold threads (HTTP, gloo) of earlier tests
TIMEOUT_S = 180


@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_every_ranks_unsharded_engine_gets_the_whole_trained_model(layout, mode):
    outcome = run_ranks(CTX, engine_seat_procs.embedded_engine_beside_parallel_trainer, 2,
                        lambda rank, port: (rank, 2, port, layout, mode), TIMEOUT_S)
    for rank in range(2):
        assert not isinstance(outcome[rank], str), outcome[rank]
        sync_mode, every_tensor, diff = outcome[rank]
        assert sync_mode == mode and every_tensor
        assert diff == 0.0  # bit for bit: the engine holds the trained weights, not its own seed's
