"""A device as the current CUDA device of the calling thread."""

import contextlib

import torch


def device_scope(device: torch.device):
    """Context in which ``device`` is this thread's current CUDA device (streams, events, NCCL, Triton launches
    and graph capture follow it); a no-op for other device types."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def current_device() -> torch.device:
    """The calling thread's current CUDA device, or the CPU where CUDA is absent."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def on_device(device: torch.device, work, *args):
    """``work(*args)`` with ``device`` as the thread's current device: for work handed to a worker thread
    (``asyncio.to_thread``), which starts on cuda:0 whatever its parent chose; kernels, streams and CUDA-graph
    capture would otherwise land on the wrong GPU of a process that is not on cuda:0."""
    with device_scope(device):
        return work(*args)
