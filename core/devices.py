"""A device as the current CUDA device of the calling thread."""

import contextlib

import torch


def device_scope(device: torch.device):
    """Context in which ``device`` is this thread's current CUDA device (streams, events, NCCL, Triton launches
    and graph capture follow it); a no-op for other device types."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
