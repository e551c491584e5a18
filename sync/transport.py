"""How bucket memory and completion fences cross a process boundary.

A transport gives the sender staging buffers that another process can map, turns a buffer into a picklable
handle and back, and provides fences: a fence recorded by one process and waited on by the other orders GPU
work across the two processes without blocking either host thread.

* ``CudaIpcTransport``: buffers are ordinary ``cudaMalloc`` memory (PyTorch's caching allocator) exported
  with ``torch.multiprocessing.reductions.reduce_tensor`` (a CUDA IPC handle); fences are interprocess CUDA
  events. Staging buffers must not come from a VMM pool (``redline.sync.memory``): VMM allocations cannot
  be exported over CUDA IPC (sync.md §1.6).
* ``SharedMemoryTransport``: CPU shared memory between processes (the same ``reduce_tensor`` path, which
  shares the storage's file descriptor). Work is synchronous on the CPU, so its fences are no-ops. The
  protocol tests run on it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import reduce_tensor

Handle = Any  # picklable; only the transport that made it interprets it


class Fence(Protocol):
    def record(self) -> None:
        """Mark the point, on the current stream, that the other side will wait for."""

    def wait(self) -> None:
        """Make the current stream wait until the last recorded point (no host blocking)."""

    def handle(self) -> Handle:
        """Picklable handle the other process passes to ``Transport.open_fence``."""


class Transport(Protocol):
    device: torch.device

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` that ``export`` can share."""

    def export(self, buffer: torch.Tensor) -> Handle:
        """A picklable handle to ``buffer``'s memory (no copy)."""

    def open(self, handle: Handle) -> torch.Tensor:
        """The buffer behind ``handle``, mapped in this process (no copy)."""

    def new_fence(self) -> Fence:
        ...

    def open_fence(self, handle: Handle) -> Fence:
        ...

    def synchronize(self) -> None:
        """Block the host until this process's queued work on the device is done."""


def _rebuild(handle: Handle) -> torch.Tensor:
    rebuild, args = handle
    return rebuild(*args)


class _NoFence:
    """A fence for synchronous (CPU) work: everything before ``record`` is already done."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def handle(self) -> Handle:
        return None


class SharedMemoryTransport:
    """CPU shared memory between processes."""

    device = torch.device("cpu")

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()

    def export(self, buffer: torch.Tensor) -> Handle:
        if buffer.device.type != "cpu":
            raise ValueError(f"SharedMemoryTransport exports CPU buffers, got one on {buffer.device}")
        if not buffer.is_shared():
            buffer.share_memory_()  # moves the storage to shared memory in place (a copy only the first time)
        return reduce_tensor(buffer)

    def open(self, handle: Handle) -> torch.Tensor:
        return _rebuild(handle)

    def new_fence(self) -> _NoFence:
        return _NoFence()

    def open_fence(self, handle: Handle) -> _NoFence:
        return _NoFence()

    def synchronize(self) -> None:
        pass


class _CudaFence:
    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event = event
        self.device = device

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def handle(self) -> Handle:
        with torch.cuda.device(self.device):  # creates the lazily made event on our device if needed
            return self.event.ipc_handle()


class CudaIpcTransport:
    """CUDA IPC between processes on the same GPU (same ``CUDA_VISIBLE_DEVICES`` ordering on both sides)."""

    def __init__(self, device: torch.device | int | str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaIpcTransport needs a CUDA GPU; none is visible (use SharedMemoryTransport "
                               "on CPU)")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else torch.device(device).index or 0)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def export(self, buffer: torch.Tensor) -> Handle:
        if buffer.device != self.device:
            raise ValueError(f"CudaIpcTransport on {self.device} cannot export a buffer on {buffer.device}")
        return reduce_tensor(buffer)

    def open(self, handle: Handle) -> torch.Tensor:
        return _rebuild(handle)

    def new_fence(self) -> _CudaFence:
        with torch.cuda.device(self.device):  # the event is created lazily on the current device
            return _CudaFence(torch.cuda.Event(interprocess=True), self.device)

    def open_fence(self, handle: Handle) -> _CudaFence:
        return _CudaFence(torch.cuda.Event.from_ipc_handle(self.device, handle), self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
