"""Next-token sampling for a batch of rows with per-row temperature, top-k, top-p and seed.

Math, per row with logits ``z [V]`` (fp32):
  greedy (temperature 0)  token = argmax z;                logp = log_softmax(z)[token]
  otherwise               p = softmax(z / temperature);    logp = log p[token]   (before truncation)
                          keep the top_k most likely tokens and the smallest prefix of them (by descending p)
                          whose mass reaches top_p; draw from p restricted to the kept set.
The draw uses the exponential race ``argmax_i p_i / E_i``, ``E_i ~ Exp(1)`` i.i.d., which samples i with
probability proportional to p_i. Rows with a seed draw their E from their own ``torch.Generator``, so their
tokens do not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden [N, H] @ weight [V, H]^T`` as fp32 ``[N, V]``.

    bf16 logits would round by up to ~0.1 at typical logit sizes, which shows up directly in log-probs; on CUDA
    the GEMM writes fp32 from its fp32 accumulator (``out_dtype``), elsewhere the product is taken in fp32.
    """
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return torch.mm(hidden.float(), weight.float().t())


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, V] bool``, True where a token survives top-k (``top_k [B] int64``, -1 = off) and top-p
    (``top_p [B] fp32``). The most likely token always survives."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    k = torch.where(top_k > 0, top_k, probs.shape[-1])
    keep_sorted = (rank[None, :] < k[:, None]) & (mass_before < top_p[:, None])
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None], device,
                      default: torch.Generator | None) -> torch.Tensor:
    """``[B, V]`` i.i.d. Exp(1); row b comes from ``generators[b]`` when set, else from ``default``."""
    noise = torch.empty(shape, device=device).exponential_(generator=default)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None], default: torch.Generator | None = None, truncate: bool = True):
    """``logits [B, V] fp32``, per-row params ``[B]`` -> ``(tokens [B] int64, logp [B] fp32)`` (see module doc).

    ``truncate=False`` promises that no row uses top-k / top-p and skips the vocabulary sort (the caller knows
    the params on the host; testing the tensors here would cost a device sync per step).
    """
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    probs = logp_all.exp()
    if truncate:
        probs = torch.where(truncation_mask(probs, top_k, top_p), probs, 0.0)
    race = probs / exponential_noise(tuple(probs.shape), generators, probs.device, default)
    tokens = torch.where(greedy, logits.argmax(dim=-1), race.argmax(dim=-1))
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)
