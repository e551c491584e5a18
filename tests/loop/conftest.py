"""Fixtures shared by the loop's test modules."""

import pytest

from redline.loop.builtin import tiny_model
from tests.loop.no_colocate_procs import NO_COLOCATE, ONE_STEP
from tests.loop.test_model_parallel import train


@pytest.fixture(scope="session")
def no_colocate_model(tmp_path_factory):
    """The quickstart's tiny model (its seed) with the vocabulary padded to a multiple of 2, as TP=2 gets it."""
    return tiny_model(tmp_path_factory.mktemp("no-colocate-model"), seed=7, vocab_multiple=2)


@pytest.fixture(scope="session")
def single_process_no_colocate(no_colocate_model, tmp_path_factory):
    """The records of the single-process ``--no-colocate`` run (``test_model_parallel.ARGS``) that the TP/PP and DP
    ``--no-colocate`` runs reproduce: made once a session (about 35 s on 2 CPU cores)."""
    return train(tmp_path_factory.mktemp("single-no-colocate"), no_colocate_model, *NO_COLOCATE)


@pytest.fixture(scope="session")
def single_process_one_step(no_colocate_model, tmp_path_factory):
    """The same with ``--async-rollout one-step`` (pushing after every second step)."""
    return train(tmp_path_factory.mktemp("single-one-step"), no_colocate_model, *NO_COLOCATE, *ONE_STEP)
