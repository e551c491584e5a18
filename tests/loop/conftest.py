"""Fixtures shared by the loop's test modules."""

import pytest

from redline.loop.builtin import tiny_model
from tests.loop.no_colocate_procs import NO_COLOCATE

from tests.loop.test_model_parallel import train


@pytest.fixture(scope="session")
def single_process_no_colocate(tmp_path_factory):
    """The records of the single-process ``--no-colocate`` run (``test_model_parallel.ARGS``, the quickstart's tiny
    model with its vocabulary padded to a multiple of 2) that the TP/PP and DP ``--no-colocate`` runs reproduce:
    made once a session (about 35 s on 2 CPU cores)."""
    model = tiny_model(tmp_path_factory.mktemp("no-colocate-model"), seed=7, vocab_multiple=2)
    return train(tmp_path_factory.mktemp("single-no-colocate"), model, *NO_COLOCATE)
