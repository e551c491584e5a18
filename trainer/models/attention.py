"""Causal attention over packed sequences (training) and over a KV cache (incremental decoding).

Packed (THD) layout: ``q [T, h, d]``, ``k/v [T, h_kv, d]``, sequences delimited by ``cu_seqlens [S+1] int32``;
no token attends across a sequence boundary. Grouped-query attention: ``h`` is a multiple of ``h_kv``.
"""

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from redline.extras import available, import_error, require
from redline.trainer.models.seq_bounds import host_bounds, max_length

# Up to this many packed tokens one SDPA call with a block-diagonal causal mask ([T, T] bool) is cheaper than
# one call per sequence length; above it the mask's T^2 memory and wasted FLOPs win over the launches.
MASKED_SDPA_MAX_TOKENS = 2048

# SDPA's kernels without cuDNN: cuDNN's builds an execution plan for each new shape, 123-165 ms fwd+bwd on the first
# call of a shape against 1.0 ms after (H100, torch 2.11, cuDNN 9.19), and RL batches bring new sequence lengths
# every step; flash took 0.74-0.77 ms, first call or not (benchmarks/sdpa_first_call.py; results in
# benchmarks/results/trainer/attention/sdpa-first-call-h100/).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa(*args, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to ``SDPA_BACKENDS`` (the backward runs the kernel the forward
    picked)."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(*args, **kwargs)


def _flash_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _flash_loads()


@functools.cache
def _flash_loads() -> bool:
    """Whether flash-attn-4 loads, decided once; an installed one that does not load is warned about, once."""
    error = import_error("flash_attn.cute")
    if error is not None and available("flash_attn"):
        warnings.warn(f"flash-attn is installed but flash_attn.cute does not load ({error}); attention runs on "
                      f"PyTorch SDPA instead", RuntimeWarning, stacklevel=4)
    return error is None


def flash_attention_usable(q: torch.Tensor) -> bool:
    return _flash_usable(q.device, q.dtype)


def varlen_attention_impl(device: torch.device | str, dtype: torch.dtype) -> str:
    """Which kernel ``varlen_causal_attention`` runs for inputs on ``device`` in ``dtype`` (for logs and
    benchmark records): ``"flash-attn-4 varlen"`` or ``"sdpa"`` (PyTorch then picks among ``SDPA_BACKENDS``)."""
    return "flash-attn-4 varlen" if _flash_usable(device, dtype) else "sdpa"


def block_causal_mask(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T, T] bool``: token i may attend token j iff same sequence and j <= i."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
    return (seq[:, None] == seq[None, :]) & (tokens[None, :] <= tokens[:, None])


def _batched(x: torch.Tensor) -> torch.Tensor:
    """``[T, h, d] -> [1, h, T, d]``: SDPA's fused (flash / memory-efficient / cuDNN) kernels take 4-D inputs
    only; 3-D inputs fall back to the fp32 math kernel (measured 5x slower for a Llama-3-8B layer, H100)."""
    return x.transpose(0, 1).unsqueeze(0)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int | None, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence: ``[T, h, d] -> [T, h, d]`` (dtype of ``q``).

    flash-attn-4 varlen when installed and on CUDA; otherwise PyTorch SDPA, with a block-diagonal mask for small
    ``T`` and one call per distinct sequence length for large ``T``.
    """
    if flash_attention_usable(q):
        flash = require("flash_attn.cute", "flash-attn-4 varlen attention")
        if max_seqlen is None:
            max_seqlen = max_length(cu_seqlens)
        out = flash.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                           max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                           softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in the betas that return the LSE
    num_tokens = q.shape[0]
    if k.shape[1] != q.shape[1]:
        # SDPA's flash kernel takes no GQA (enable_gqa sends it to the math kernel): expand the KV heads.
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if num_tokens <= MASKED_SDPA_MAX_TOKENS:
        mask = block_causal_mask(cu_seqlens, num_tokens)
        out = _sdpa(*(_batched(t) for t in (q, k, v)), attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)
    return _sdpa_per_length(q, k, v, host_bounds(cu_seqlens), scale)


def _sdpa_per_length(q, k, v, bounds: list[int], scale: float) -> torch.Tensor:
    """One causal SDPA call per distinct sequence length, the sequences of that length stacked as a batch
    (RL and benchmark streams often hold many sequences of one length: a Python loop over sequences would pay
    one launch chain each). Sequences that sit next to each other are viewed, not copied."""
    starts_of: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            starts_of.setdefault(end - start, []).append(start)
    pieces = {}
    for length, starts in starts_of.items():
        if starts == list(range(starts[0], starts[0] + length * len(starts), length)):
            span = slice(starts[0], starts[0] + length * len(starts))
            qs, ks, vs = (t[span].unflatten(0, (len(starts), length)) for t in (q, k, v))
        else:
            qs, ks, vs = (torch.stack([t[s:s + length] for s in starts]) for t in (q, k, v))
        out = _sdpa(*(t.transpose(1, 2) for t in (qs, ks, vs)), is_causal=True, scale=scale)
        out = out.transpose(1, 2)  # [n, L, h, d]
        if len(starts_of) == 1 and len(starts) * length == q.shape[0]:
            return out.reshape(q.shape[0], *out.shape[2:])
        pieces.update(zip(starts, out.unbind(0)))
    if not pieces:
        return q.new_empty(q.shape)
    return torch.cat([pieces[start] for start in sorted(pieces)])


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of new tokens to a KV cache: ``q [B, L, h, d]``, caches ``[B, h_kv, S, d]``,
    ``positions [B, L] int64`` -> ``[B, L, h, d]``.

    Row b token j sees cache slots ``0..positions[b, j]``. Padding tokens (position -1) see slot 0 only, so
    their softmax stays finite; their output is unspecified. Shapes are static (no host sync), so one decode
    step can be captured in a CUDA graph. A decode step (``L == 1``) on CUDA runs
    ``decode_attention``'s kernel; otherwise SDPA with a visibility mask.
    """
    if q.shape[1] == 1 and q.is_cuda:
        from redline.trainer.models.decode_attention import decode_attention

        return decode_attention(q[:, 0], k_cache, v_cache, positions[:, 0], scale)[:, None]
    slots = torch.arange(k_cache.shape[2], device=positions.device)
    visible = slots[None, None, :] <= positions.clamp(min=0)[:, :, None]  # [B, L, S]
    out = _sdpa(q.transpose(1, 2), k_cache, v_cache, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


class VarlenAttention(nn.Module):
    """Core attention of the ``bf16``/``native`` backends: ``forward(q, k, v, cu_seqlens, max_seqlen)``."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, cu_seqlens, max_seqlen=None):
        return varlen_causal_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
