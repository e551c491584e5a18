"""Alignment padding of packed batches leaves real tokens untouched."""

import pytest
import torch

from redline.trainer.fp8.linear import NativeFP8Backend
from redline.trainer.models import from_config
from redline.trainer.padding import pad_packed, token_multiple


def test_padding_appends_one_sequence_up_to_the_multiple():
    input_ids, cu_seqlens = pad_packed(torch.arange(1, 11), torch.tensor([0, 4, 10], dtype=torch.int32), 16)
    assert input_ids.shape == (16,) and input_ids[10:].eq(0).all()
    assert cu_seqlens.tolist() == [0, 4, 10, 16] and cu_seqlens.dtype == torch.int32


def test_aligned_batch_is_returned_unchanged():
    input_ids, cu_seqlens = torch.arange(16), torch.tensor([0, 16], dtype=torch.int32)
    assert pad_packed(input_ids, cu_seqlens, 16) == (input_ids, cu_seqlens)


def test_padding_does_not_change_real_tokens_hidden_states(config_of, batch_of):
    config = config_of("llama3")
    model = from_config(config, dtype=torch.float32, seed=0)
    input_ids, cu_seqlens = batch_of((5, 6), config.vocab_size)
    padded_ids, padded_cu = pad_packed(input_ids, cu_seqlens, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(padded_ids, padded_cu)[:11], model(input_ids, cu_seqlens))


def test_token_multiple_follows_the_backend(config_of):
    config = config_of("qwen3")
    assert token_multiple(from_config(config, dtype=torch.float32)) == 1
    assert token_multiple(from_config(config, backend=NativeFP8Backend(), dtype=torch.float32)) == 16


def test_zero_multiple_is_rejected():
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        pad_packed(torch.arange(3), torch.tensor([0, 3], dtype=torch.int32), 0)
