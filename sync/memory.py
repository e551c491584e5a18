"""Pausable trainer memory: redline's native VMM allocator behind a ``torch.cuda.MemPool``.

Tensors allocated inside ``with memory.region():`` (parameters, gradients, optimizer state, activations) live
in virtual-memory allocations of ``native/vmm_allocator.cpp``. ``pause()`` releases their physical memory
(optionally keeping the contents in pinned host memory) and ``resume()`` maps new memory at the same
addresses, so every tensor, pointer and CUDA graph stays valid. The pinned host buffers that hold paused
contents are made at the first pause that keeps contents and reused by every later one (pinning costs far
more than copying); ``release_host_memory()`` gives them back.

Rules of use:

* nothing may touch pool memory while paused (no kernels on pooled tensors, no allocation in the region);
* the native allocator is one per process: ``pause``/``resume`` act on every allocation it made, whichever
  ``PausableMemory`` made it;
* pool memory cannot cross CUDA IPC: allocate sync staging buffers outside ``region()``.

``zeros()`` makes a tensor in an allocation of its own, outside the pool, and ``pause_tensors()`` releases a
chosen set of such allocations, each keeping its contents or not: the trainer's state pauses group by group
(``redline.loop.train_offload``).

The library is built by ``pip install -e . --no-build-isolation`` when nvcc and cmake are present and copied
next to this file; ``REDLINE_NATIVE_LIBRARY`` points elsewhere (e.g. a build directory).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from functools import lru_cache
from pathlib import Path

import torch

NATIVE_LIBRARY = "libredline_native.so"
ALLOC_FN, FREE_FN = "redline_vmm_malloc", "redline_vmm_free"
STAT_NAMES = ("mapped_bytes", "reserved_bytes", "host_backup_bytes", "host_allocations", "allocation_count")
_EXPORTS = [f"redline_vmm_{name}" for name in ("malloc", "free", "pause", "pause_some", "allocation_bytes", "resume",
                                                "release_host", "last_error", "use_fake_driver", *STAT_NAMES)]


class NativeLibraryMissing(RuntimeError):
    """The native library was not built for this install (no CUDA toolkit at install time)."""


def native_library_path() -> Path:
    """Where the native library is; NativeLibraryMissing saying how to build it when it is not."""
    override = os.environ.get("REDLINE_NATIVE_LIBRARY")
    path = Path(override) if override else Path(__file__).with_name(NATIVE_LIBRARY)
    if not path.is_file():
        source = "REDLINE_NATIVE_LIBRARY" if override else "the redline.sync package"
        raise NativeLibraryMissing(
            f"redline's native library {path} (from {source}) does not exist. It is built from native/*.cpp by "
            "`pip install -e . --no-build-isolation` when nvcc and cmake are on PATH (CPU installs skip it), or "
            "by hand: cmake -S . -B build/native && cmake --build build/native, then set "
            "REDLINE_NATIVE_LIBRARY=build/native/libredline_native.so. Pausable trainer memory needs it.")
    return path


@lru_cache(maxsize=None)
def load_native(path: str | None = None) -> ctypes.CDLL:
    """The native library with its C signatures declared (loading needs no GPU: libcuda is looked up lazily)."""
    path = str(path or native_library_path())
    lib = ctypes.CDLL(path)
    missing = [name for name in _EXPORTS if not hasattr(lib, name)]
    if missing:
        raise NativeLibraryMissing(f"redline's native library {path} is out of date (it lacks {missing}); rebuild "
                                   "it: pip install -e . --no-build-isolation (or cmake --build build/native and "
                                   "copy libredline_native.so next to redline/sync/memory.py)")
    lib.redline_vmm_malloc.restype = ctypes.c_void_p
    lib.redline_vmm_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.redline_vmm_free.restype = None
    lib.redline_vmm_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.redline_vmm_pause.restype = ctypes.c_int
    lib.redline_vmm_pause.argtypes = [ctypes.c_int]
    lib.redline_vmm_pause_some.restype = ctypes.c_int
    lib.redline_vmm_pause_some.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                                           ctypes.c_size_t]
    lib.redline_vmm_allocation_bytes.restype = ctypes.c_size_t
    lib.redline_vmm_allocation_bytes.argtypes = [ctypes.c_void_p]
    lib.redline_vmm_resume.restype = ctypes.c_int
    lib.redline_vmm_resume.argtypes = []
    for name in STAT_NAMES + ("release_host",):
        getattr(lib, f"redline_vmm_{name}").restype = ctypes.c_size_t
    lib.redline_vmm_use_fake_driver.restype = ctypes.c_int
    lib.redline_vmm_last_error.restype = ctypes.c_char_p
    return lib


class PausableMemory:
    """A CUDA memory pool whose physical memory can be released and restored at the same addresses."""

    def __init__(self, device: torch.device | int | str | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("PausableMemory needs a CUDA GPU; none is visible")
        path = native_library_path()
        self.lib = load_native(str(path))
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else torch.device(device).index or 0)
        self.allocator = torch.cuda.memory.CUDAPluggableAllocator(str(path), ALLOC_FN, FREE_FN)
        self.pool = torch.cuda.MemPool(self.allocator.allocator())
        self.paused = False

    @contextlib.contextmanager
    def region(self):
        """Allocations on this pool's device inside the block come from pausable memory."""
        if self.pool is None:
            raise RuntimeError("PausableMemory.region(): the host imitation has no pool (use zeros())")
        if self.paused:
            raise RuntimeError("PausableMemory.region() while paused: resume() first")
        with torch.cuda.device(self.device), torch.cuda.use_mem_pool(self.pool):
            yield

    def pause(self, keep_contents: bool = True) -> None:
        """Release the physical memory of every pausable allocation (contents copied to pinned host memory
        first when ``keep_contents``, all copies queued back to back on one stream). Waits for all queued
        device work."""
        torch.cuda.synchronize(self.device)
        self._check(self.lib.redline_vmm_pause(int(keep_contents)), "pause")
        self.paused = True

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``[numel]`` zeros of ``dtype`` in a native allocation of their own (not through the pool, whose
        blocks may share an allocation), so ``pause_tensors`` can release them apart from everything else; the
        allocation is freed with the last tensor that views it. On the host imitation: host tensors."""
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        index = self.device.index or 0
        pointer = self.lib.redline_vmm_malloc(nbytes, index, None)
        if not pointer:
            raise RuntimeError(f"PausableMemory.zeros({numel}, {dtype}) failed: "
                               f"{self.lib.redline_vmm_last_error().decode()}")
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                raw = torch.as_tensor(_DeviceAllocation(self.lib, pointer, nbytes, index), device=self.device)
            if raw.data_ptr() != pointer:  # torch copied instead of viewing: the pause would miss this tensor
                raise RuntimeError("PausableMemory.zeros: torch copied the native allocation instead of viewing it")
        else:
            raw = torch.frombuffer(_host_allocation(self.lib, pointer, nbytes), dtype=torch.uint8)
        return raw.view(dtype)[:numel].zero_()

    def pause_tensors(self, tensors: list[torch.Tensor], keep_contents: list[bool]) -> None:
        """Release the physical memory of the allocations holding ``tensors`` (each made by ``zeros``), the
        contents of those whose ``keep_contents`` is set copied to pinned host memory first; ``resume()`` maps
        them back (with every other paused allocation). Waits for all queued device work."""
        if len(tensors) != len(keep_contents):
            raise ValueError(f"pause_tensors: {len(tensors)} tensors but {len(keep_contents)} keep_contents flags")
        if not tensors:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        pointers = (ctypes.c_void_p * len(tensors))(*(t.untyped_storage().data_ptr() for t in tensors))
        flags = (ctypes.c_int * len(tensors))(*map(int, keep_contents))
        self._check(self.lib.redline_vmm_pause_some(pointers, flags, len(tensors)), "pause_tensors")

    def allocation_bytes(self, tensor: torch.Tensor) -> int:
        """Device bytes the allocation holding ``tensor`` (made by ``zeros``) maps while not paused: its size
        rounded up to the driver's granularity."""
        return int(self.lib.redline_vmm_allocation_bytes(tensor.untyped_storage().data_ptr()))

    @classmethod
    def host_imitation(cls, library: str | Path) -> PausableMemory:
        """CPU tests: memory from the native library at ``library`` switched to its host-memory imitation of the
        driver (the switch holds for that file's whole process: give it a private copy). ``zeros`` gives host
        tensors; the pool (``region``) does not exist."""
        memory = cls.__new__(cls)
        memory.lib = load_native(str(library))
        if memory.lib.redline_vmm_use_fake_driver() != 0:
            raise RuntimeError(f"{library} already made allocations with the real driver")
        memory.device, memory.allocator, memory.pool, memory.paused = torch.device("cpu"), None, None, False
        return memory

    def resume(self) -> None:
        """Map physical memory back at the same addresses and restore kept contents (the pinned host buffers
        stay allocated for the next pause)."""
        self._check(self.lib.redline_vmm_resume(), "resume")
        self.paused = False

    def release_host_memory(self) -> int:
        """Free the pinned host buffers kept for later pauses (not those holding paused contents); returns the
        bytes freed. The next pause with contents pins new ones."""
        return int(self.lib.redline_vmm_release_host())

    def stats(self) -> dict[str, int]:
        """Bytes mapped (physically backed), reserved (address space), held in pinned host memory (holding
        paused contents or kept for the next pause), pinned host buffers made so far, and the number of live
        allocations of the native allocator (whole process)."""
        return {name: int(getattr(self.lib, f"redline_vmm_{name}")()) for name in STAT_NAMES}

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"PausableMemory.{what} failed: {self.lib.redline_vmm_last_error().decode()}")


class _DeviceAllocation:
    """One native device allocation handed to torch through ``__cuda_array_interface__`` (torch keeps this
    object alive as long as any tensor views it); freed when torch lets go."""

    def __init__(self, lib, pointer: int, nbytes: int, device: int):
        self.lib, self.pointer, self.nbytes, self.device = lib, pointer, nbytes, device
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 2}

    def __del__(self):
        torch.cuda.synchronize(self.device)  # kernels queued on the last views may still read it
        self.lib.redline_vmm_free(self.pointer, self.nbytes, self.device, None)


def _host_allocation(lib, pointer: int, nbytes: int):
    """The host imitation's allocation at ``pointer`` as a buffer ``torch.frombuffer`` can view (torch keeps it
    alive as long as any tensor views it); freed when torch lets go."""
    free = lambda self: lib.redline_vmm_free(pointer, nbytes, 0, None)
    return type("HostAllocation", (ctypes.c_uint8 * nbytes,), {"__del__": free}).from_address(pointer)
