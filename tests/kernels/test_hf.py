"""causal_lm_logprobs on a tiny random Qwen3 against the model's own logits."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from redline.kernels.hf import causal_lm_logprobs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


def test_logprobs_and_entropy_match_the_models_logits(model):
    input_ids = torch.randint(0, 211, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0  # right padding
    with torch.no_grad():
        logp, entropy = causal_lm_logprobs(model, input_ids, attention_mask=attention_mask, temperature=0.8,
                                           return_entropy=True)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].double() / 0.8
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = log_probs.gather(2, input_ids[:, 1:, None])[..., 0]
    expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
    valid = attention_mask[:, 1:].bool()
    torch.testing.assert_close(logp[valid].double(), expected[valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[valid].double(), expected_entropy[valid], rtol=0, atol=1e-5)
    assert torch.all(logp[~valid] == 0)


def test_gradient_reaches_the_lm_head_and_the_decoder(model):
    input_ids = torch.randint(0, 211, (1, 7))
    logp, _ = causal_lm_logprobs(model, input_ids)
    model.zero_grad()
    logp.sum().backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_a_head_with_bias_is_rejected(model):
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(211))
    try:
        with pytest.raises(ValueError, match="bias-free"):
            causal_lm_logprobs(model, torch.randint(0, 211, (1, 4)))
    finally:
        model.lm_head.bias = None
