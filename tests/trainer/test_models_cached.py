"""Incremental decoding (KV cache) reproduces the packed forward."""

import pytest
import torch

from redline.trainer.models import KVCache, from_config

PROMPTS = (4, 7, 2)  # different lengths: batched prefill is right-padded with position -1
DECODE_STEPS = 3


def test_prefill_then_decode_reproduces_packed_forward(hf_config, batch_of):
    model = from_config(hf_config, dtype=torch.float32, seed=0)
    lengths = [p + DECODE_STEPS for p in PROMPTS]
    input_ids, cu_seqlens = batch_of(lengths, hf_config.vocab_size)
    with torch.no_grad():
        expected = model(input_ids, cu_seqlens)
    sequences = input_ids.split(lengths)
    expected = expected.split(lengths)

    batch, width = len(PROMPTS), max(PROMPTS)
    prompt_ids = torch.zeros(batch, width, dtype=torch.long)
    positions = torch.full((batch, width), -1, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        prompt_ids[b, :p] = sequences[b][:p]
        positions[b, :p] = torch.arange(p)
    cache = model.make_kv_cache(batch, max_seq_len=16)
    with torch.no_grad():
        prefill = model.forward_cached(prompt_ids, positions, cache)
        for b, p in enumerate(PROMPTS):
            torch.testing.assert_close(prefill[b, :p], expected[b][:p], rtol=1e-5, atol=1e-5)
        for step in range(DECODE_STEPS):
            ids = torch.stack([sequences[b][p + step] for b, p in enumerate(PROMPTS)])[:, None]
            pos = torch.tensor([p + step for p in PROMPTS])[:, None]
            out = model.forward_cached(ids, pos, cache)
            for b, p in enumerate(PROMPTS):
                torch.testing.assert_close(out[b, 0], expected[b][p + step], rtol=1e-5, atol=1e-5)


def test_padding_tokens_leave_the_visible_cache_untouched(config_of):
    model = from_config(config_of("qwen3"), dtype=torch.float32, seed=0)
    cache = model.make_kv_cache(1, max_seq_len=8)
    ids = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        model.forward_cached(ids, torch.tensor([[0, 1, -1]]), cache)
    assert cache.k[:, :, :, 2:8].abs().sum() == 0  # slots after the last real token
    assert cache.k[:, :, :, :2].abs().sum() > 0


def test_kv_cache_shape_follows_the_model(config_of):
    config = config_of("qwen3")
    cache = from_config(config, dtype=torch.float32, seed=0).make_kv_cache(2, max_seq_len=10)
    assert cache.k.shape == (config.num_hidden_layers, 2, config.num_key_value_heads, 11, config.head_dim)


def test_kv_cache_rejects_a_zero_size():
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(1, 1, 0, 1, 8, dtype=torch.float32, device="cpu")
