"""TransformerEngine backend (GPU + TE only): same model as bf16, FP8 recipes within a log-prob bound."""

import pytest
import torch
import torch.nn.functional as F

from redline.trainer.layers import layer_backend
from redline.trainer.models import from_config

pytestmark = [pytest.mark.gpu, pytest.mark.te]

LENGTHS = (48, 80)  # 128 tokens: aligned for every recipe (block scaling needs 128)


def log_probs(model, input_ids, cu_seqlens):
    with torch.no_grad():
        logits = model.logits(input_ids, cu_seqlens).float()
    return F.log_softmax(logits, -1).gather(1, input_ids.roll(-1)[:, None]).squeeze(1)


def te_config(config_of):
    config = config_of("qwen3")
    config.hidden_size, config.intermediate_size, config.head_dim = 128, 256, 32
    return config


def test_te_modules_without_fp8_match_the_bf16_backend(config_of, batch_of, cuda):
    config = te_config(config_of)
    input_ids, cu_seqlens = (t.to(cuda) for t in batch_of(LENGTHS, config.vocab_size))
    reference = from_config(config, dtype=torch.bfloat16, device=cuda, seed=0)
    te_model = from_config(config, backend=layer_backend("te", recipe=None), dtype=torch.bfloat16, device=cuda,
                           seed=0)
    for (name, p), (_, q) in zip(reference.export_hf(), te_model.export_hf()):
        assert torch.equal(p, q), name
    delta = (log_probs(te_model, input_ids, cu_seqlens) - log_probs(reference, input_ids, cu_seqlens)).abs()
    assert delta.max() < 0.05


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_te_fp8_log_probs_stay_close_to_bf16(config_of, batch_of, cuda, recipe):
    config = te_config(config_of)
    input_ids, cu_seqlens = (t.to(cuda) for t in batch_of(LENGTHS, config.vocab_size))
    reference = from_config(config, dtype=torch.bfloat16, device=cuda, seed=0)
    fp8 = from_config(config, backend=layer_backend("te", recipe=recipe), dtype=torch.bfloat16, device=cuda, seed=0)
    delta = (log_probs(fp8, input_ids, cu_seqlens) - log_probs(reference, input_ids, cu_seqlens)).abs()
    print(f"TE {recipe} vs bf16: mean |dlogp| {delta.mean():.4f}, max {delta.max():.4f}")
    assert delta.mean() < 0.05 and delta.max() < 0.5
