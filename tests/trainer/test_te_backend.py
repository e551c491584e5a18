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


def test_te_model_never_runs_te_unfused_attention(config_of, batch_of, cuda):
    """attention="auto": TE's attention only when TE runs it fused (cuDNN) or flash, else redline's varlen."""
    from redline.trainer.layers.te_layers import FAST_TE_ATTENTION, selected_te_backend, te_attention_record

    config = te_config(config_of)
    input_ids, cu_seqlens = (t.to(cuda) for t in batch_of(LENGTHS, config.vocab_size))
    backend = layer_backend("te", recipe="current")
    model = from_config(config, backend=backend, dtype=torch.bfloat16, device=cuda, seed=0)
    print(f"te backend attention: {backend.attention_impl}")
    assert backend.attention_impl.startswith(("te:", "redline:"))
    assert "Unfused" not in backend.attention_impl
    log_probs(model, input_ids, cu_seqlens)
    if backend.attention_impl.startswith("te:"):
        assert selected_te_backend(te_attention_record()) in FAST_TE_ATTENTION


def test_te_attention_and_redline_attention_agree_inside_a_te_model(config_of, batch_of, cuda):
    from redline.trainer.layers.te_layers import FAST_TE_ATTENTION, probe_te_attention

    config = te_config(config_of)
    selected, problem = probe_te_attention(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if selected not in FAST_TE_ATTENTION or problem:
        pytest.skip(f"TE's attention is not usable here: {selected}, {problem}")
    input_ids, cu_seqlens = (t.to(cuda) for t in batch_of(LENGTHS, config.vocab_size))
    te_attention, redline_attention = (
        from_config(config, backend=layer_backend("te", recipe=None, attention=choice), dtype=torch.bfloat16,
                    device=cuda, seed=0) for choice in ("te", "redline"))
    delta = (log_probs(te_attention, input_ids, cu_seqlens) - log_probs(redline_attention, input_ids,
                                                                         cu_seqlens)).abs()
    assert delta.max() < 0.05
