"""Fixtures shared by the rollout tests: a tokenizer trained on the spot (no download)."""

import pytest
from redline.rollout.model_dir import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint with peaked next-token distributions (clear greedy margins)."""
    from redline.rollout.model_dir import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), initializer_range=0.3)
