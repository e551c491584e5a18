"""Fixtures shared by the rollout tests: a tokenizer trained on the spot (no download)."""

import pytest

from redline.rollout.model_dir import train_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer()
