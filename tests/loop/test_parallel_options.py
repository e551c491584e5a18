"""The loop's parallel options reach the process groups' ``ParallelConfig``: ``--tp-comm-overlap`` (off by
default) and ``--decoder-first/last-pipeline-num-layers``."""

import pytest
import torch.multiprocessing as mp

from redline.config import RunConfig
from tests.loop.parallel_options_procs import free_port, options_worker  # importable by the spawned ranks


def test_async_tp_is_off_by_default():
    assert RunConfig().parallel.tp_comm_overlap is False


@pytest.mark.parametrize("kwargs, expected", [
    (dict(tp=2, sp=True, tp_overlap="off"), {"tp": 2, "sp": True, "tp_overlap": "off"}),
    (dict(tp=2, sp=True, tp_overlap="auto"), {"tp": 2, "sp": True, "tp_overlap": "auto"}),
    (dict(pp=2, last_stage_layers=1), {"pp": 2, "first_stage_layers": None, "last_stage_layers": 1}),
])
def test_parallel_options_reach_the_groups(kwargs, expected):
    mp.spawn(options_worker, args=(free_port(), kwargs, expected), nprocs=2, join=True)
