"""Preallocated key/value cache for incremental decoding (the embedded rollout engine)."""

import torch


class KVCache:
    """K and V for every layer: ``k[layer], v[layer]`` are ``[B, h_kv, max_seq_len + 1, d]``.

    The extra last slot is scratch: padding tokens (position -1) write there, which keeps writes static-shaped
    (no masking, no host sync); no query ever attends to it because attention stops at the query's position.
    """

    def __init__(self, num_layers: int, batch_size: int, max_seq_len: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str):
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("max_seq_len", max_seq_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if value < 1:
                raise ValueError(f"KVCache {name} must be >= 1, got {value}")
        self.max_seq_len = max_seq_len
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Cache slot per token: its position, or the scratch slot for padding (-1)."""
        return torch.where(positions < 0, self.max_seq_len, positions)
