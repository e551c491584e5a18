"""Rotary position embeddings: frequencies from transformers' own RoPE tables, applied to packed tokens."""

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] fp32, attention_scaling)`` for the config's ``rope_parameters``.

    Scaled variants (``llama3``, ``linear``, ``yarn`` ...) come from ``transformers.modeling_rope_utils`` so the
    numbers are exactly HF's; the default is the plain ``theta^(-2i/d)``.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    if rope_type == "dynamic":
        raise ValueError("config.json rope_type='dynamic' depends on the running length; not supported")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"config.json rope_type={rope_type!r} is unknown to transformers")
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; ``forward(positions [...]) -> (cos, sin) [..., head_dim]`` in ``dtype``."""

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        inv_freq, self.attention_scaling = inverse_frequencies(config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., heads, head_dim]`` by ``cos/sin [..., head_dim]`` (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def packed_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of each token within its own sequence: ``[T] int64`` from ``cu_seqlens [S+1] int32``.

    Computed on the device without reading ``cu_seqlens`` back to the host.
    """
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    seq_index = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
    return tokens - cu_seqlens.long()[seq_index]
