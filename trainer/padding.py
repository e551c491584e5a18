"""Pad a packed batch only as far as FP8 and tensor/sequence parallelism need.

The padding is one extra sequence at the end of the stream, so it attends to nothing real and changes no real
token's output; give its tokens a zero loss mask.
"""

import torch


def token_multiple(model) -> int:
    """The multiple a packed token count must be for ``model``: its backend's FP8 alignment, times the TP
    degree under sequence parallelism (each rank's token shard is quantised before the all-gather in TE)."""
    multiple = model.backend.token_alignment
    state = getattr(model, "parallel_state", None)
    if state is not None and state.sp:
        multiple *= state.tp
    return multiple


def pad_packed(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int,
               pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [T]``, ``cu_seqlens [S+1]`` -> the same with a padding sequence appended so that the token
    count is a multiple of ``multiple`` (unchanged when it already is)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    pad = -input_ids.shape[0] % multiple
    if pad == 0:
        return input_ids, cu_seqlens
    input_ids = torch.cat([input_ids, input_ids.new_full((pad,), pad_id)])
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([input_ids.shape[0]])])
    return input_ids, cu_seqlens
