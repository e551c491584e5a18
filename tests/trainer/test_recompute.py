"""Activation recompute changes memory, not results."""

import pytest
import torch

from redline.trainer.models import from_config
from redline.trainer.parallel import apply_recompute


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(config_of, batch_of, mode):
    config = config_of("qwen3")
    plain = from_config(config, dtype=torch.float32, seed=0)
    recomputed = from_config(config, dtype=torch.float32, seed=0)
    apply_recompute(recomputed, mode)
    input_ids, cu_seqlens = batch_of((5, 7), config.vocab_size)
    for model in (plain, recomputed):
        model.logits(input_ids, cu_seqlens).logsumexp(-1).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_unknown_recompute_mode_is_rejected(config_of):
    with pytest.raises(ValueError, match="recompute='some'"):
        apply_recompute(from_config(config_of("qwen3"), dtype=torch.float32), "some")
