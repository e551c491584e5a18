"""Tiny HF configs of each supported family, shared by the trainer tests (CPU, fp32, a few ms per forward)."""

import pytest
import torch
import transformers

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_config(family: str) -> transformers.PretrainedConfig:
    """A small config per test family; every variant the decoder must handle appears in at least one."""
    if family == "llama3":  # untied, llama3 RoPE scaling
        return transformers.LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    if family == "llama3-tied":
        return transformers.LlamaConfig(**TINY, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":  # q/k/v biases, tied
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":  # q/k norm, explicit head_dim != hidden/heads, untied
        return transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False)
    if family == "qwen3-tied":
        return transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)
    raise ValueError(family)


FAMILIES = ("llama3", "llama3-tied", "qwen2", "qwen3", "qwen3-tied")


@pytest.fixture(params=FAMILIES)
def hf_config(request) -> transformers.PretrainedConfig:
    """Each family's tiny config in turn."""
    return tiny_config(request.param)


@pytest.fixture
def config_of():
    """``config_of(family)`` for tests that need one particular family."""
    return tiny_config


@pytest.fixture
def batch_of():
    """``batch_of(lengths, vocab_size, seed=0) -> (input_ids, cu_seqlens)``."""
    return packed_batch


def packed_batch(lengths, vocab_size, seed=0):
    """Random ``input_ids [T] int64`` and ``cu_seqlens [S+1] int32`` for sequences of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (sum(lengths),), generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return input_ids, cu_seqlens
