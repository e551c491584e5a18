"""Per-token log-probs of a transformers ``*ForCausalLM`` without materialising its ``[T, V]`` logits."""

from typing import Optional

import torch

from .linear_logprobs import fused_linear_logprobs


def causal_lm_logprobs(model, input_ids: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
                       temperature: float = 1.0, return_entropy: bool = False, **model_kwargs):
    """Log-prob of each next token under ``model``: ``(logp [B, L-1] fp32, entropy [B, L-1] fp32 or None)``.

    ``logp[b, t] = log softmax(lm_head(h[b, t]) / temperature)[input_ids[b, t+1]]`` where ``h`` is the last
    hidden state of ``model.model`` (the decoder under the head). The head runs through
    ``fused_linear_logprobs``; positions whose target is padding (``attention_mask[b, t+1] == 0``) return 0 and
    cost nothing. Works for heads that are a bias-free ``nn.Linear`` (``model.get_output_embeddings()``), tied
    or not; a model with a bias, logit soft-capping or a logit scale raises ValueError rather than being
    computed wrongly.
    """
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"model's output embedding must be a bias-free nn.Linear, got {type(head).__name__}")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) not in (None, 1.0):
            raise ValueError(f"model.config.{name}={getattr(model.config, name)} is not supported by the fused head")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, L] with L >= 2, got {tuple(input_ids.shape)}")
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs).last_hidden_state
    batch, length = input_ids.shape
    width = hidden.shape[-1]
    flat_hidden = hidden[:, :-1].reshape(-1, width)
    targets = input_ids[:, 1:].reshape(-1)
    mask = None if attention_mask is None else attention_mask[:, 1:].reshape(-1).bool()
    weight = head.weight.to(flat_hidden.dtype)
    logp, entropy = fused_linear_logprobs(flat_hidden, weight, targets, temperature=temperature, mask=mask,
                                          return_entropy=return_entropy)
    shape = (batch, length - 1)
    return logp.view(shape), None if entropy is None else entropy.view(shape)
