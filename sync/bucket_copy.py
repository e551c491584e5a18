"""Copies between a flat bucket and its tensors that accumulate the bucket's checksum in the same pass.

The sync moves every byte once per side (the sender packs, the receiver loads) and must check every bucket on
both sides; a separate checksum pass reads every byte a second time (half an HBM copy of the model per side,
``stage: checksum only`` in benchmarks/bench_sync.py). ``BucketCopier`` does both in one Triton launch per
bucket: each program copies one piece of one tensor (the piece of it inside one checksum row) and adds the
piece's contribution to the bucket's checksum (``redline.sync.checksum``: a word's contribution depends only on
its value and its bucket position, so pieces add up in any order). One launch per bucket, whatever its number
of tensors: the per-tensor Python and launch overhead of a copy loop is gone too.

* ``pack(flat, nbytes, spans, tensors, acc)``: ``tensors[i]`` -> ``flat[start_i:end_i]`` (the sender's staging)
* ``unpack(flat, nbytes, spans, tensors, acc)``: ``flat[start_i:end_i]`` -> ``tensors[i]`` (a receiver's load;
  a ``None`` tensor is checksummed, not copied)
* ``checksum(flat, nbytes, acc)``: checksum only (the zero-copy sender)
* ``gather_checksum(flat, nbytes, spans, tensors, acc)``: the checksum ``pack`` would give, read from the
  tensors where they lie, nothing copied (an engine checking the parameters it loaded against the bucket)

``acc`` is one bucket's ``[LANES, 2]`` int64 accumulator (``checksum.new_accumulator``), added to, never reset.
Tensors are addressed by their distance from one base pointer (a table per bucket, cached by addresses), so
one kernel serves any number of tensors without per-tensor arguments. When every address and offset is
16-byte aligned (the usual case) the kernel moves int64 words with 16-byte vector hints; otherwise it moves the
largest unit (4, 2 or 1 bytes) that every address and offset is a multiple of.

Backends: ``triton`` (CUDA; CPU tensors under ``TRITON_INTERPRET=1``, as the tests run it) and ``torch``
(``_foreach_copy_`` plus ``bucket_checksum`` of the flat bucket: the CPU path, and the reference).
``REDLINE_SYNC_COPY=torch|triton`` overrides the default (triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from redline.sync.checksum import LANES, ROW_BYTES, bucket_checksum

BACKEND_ENV = "REDLINE_SYNC_COPY"
_UNIT_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TABLE_CACHE = 512  # address tables (small): one per bucket and set of tensor addresses
_OWNER_CACHE = 1024  # piece maps (4 bytes per 8 KiB of bucket): one per bucket layout


def choose_backend(device: torch.device, backend: str | None = None) -> str:
    choice = backend or os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    if choice not in ("torch", "triton"):
        raise ValueError(f"{BACKEND_ENV} (or backend=) must be 'torch' or 'triton', got {choice!r}")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton bucket copy on {device} tensors needs TRITON_INTERPRET=1 (the interpreter)")
    return choice


class BucketCopier:
    """Fused bucket copy + checksum (see the module docstring). One per process side; keeps small caches of
    per-bucket tables on the device (address tables keyed by the tensors' addresses, piece maps by layout)."""

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self._tables: OrderedDict[tuple, tuple] = OrderedDict()  # -> (table, owner, programs, unit, vec)
        self._owners: OrderedDict[tuple, tuple[torch.Tensor, list[int]]] = OrderedDict()

    def pack(self, flat: torch.Tensor, nbytes: int, spans: Sequence[tuple[int, int]],
             tensors: Sequence[torch.Tensor], acc: torch.Tensor, row_stride: int = 1) -> None:
        """``tensors[i]`` -> bytes ``spans[i] = (start, end)`` of ``flat``; checksum of ``flat[:nbytes]``."""
        if any(t is None for t in tensors):
            raise ValueError("pack needs a tensor for every span")
        self._run("pack", flat, nbytes, spans, tensors, acc, row_stride)

    def unpack(self, flat: torch.Tensor, nbytes: int, spans: Sequence[tuple[int, int]],
               tensors: Sequence[torch.Tensor | None], acc: torch.Tensor, row_stride: int = 1) -> None:
        """Bytes ``spans[i]`` of ``flat`` -> ``tensors[i]`` (``None``: not copied); checksum of the spans' bytes
        (the whole bucket when the spans cover it, as a plan's layout does)."""
        self._run("unpack", flat, nbytes, spans, tensors, acc, row_stride)

    def checksum(self, flat: torch.Tensor, nbytes: int, acc: torch.Tensor, row_stride: int = 1) -> None:
        """Checksum of ``flat[:nbytes]`` only."""
        self._run("checksum", flat, nbytes, [(0, nbytes)], [None], acc, row_stride)

    def gather_checksum(self, flat: torch.Tensor, nbytes: int, spans: Sequence[tuple[int, int]],
                        tensors: Sequence[torch.Tensor], acc: torch.Tensor, row_stride: int = 1) -> None:
        """The checksum ``pack(flat, nbytes, spans, tensors, ...)`` would accumulate, read from ``tensors``
        in place: neither they nor ``flat`` (only the address origin and the byte count) are written."""
        if any(t is None for t in tensors):
            raise ValueError("gather_checksum needs a tensor for every span")
        self._run("gather", flat, nbytes, spans, tensors, acc, row_stride)

    # -----------------------------------------------------------------------------------------------------
    def _run(self, direction, flat, nbytes, spans, tensors, acc, row_stride):
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < nbytes:
            raise ValueError(f"the flat bucket must be flat uint8 of >= {nbytes} bytes, got {flat.dtype} "
                             f"{tuple(flat.shape)}")
        if flat.data_ptr() % 8:
            raise ValueError("the flat bucket must start at an 8-byte aligned address")
        if row_stride < 1:
            raise ValueError(f"row_stride must be >= 1, got {row_stride}")
        if len(spans) != len(tensors):
            raise ValueError(f"{len(spans)} spans for {len(tensors)} tensors")
        if acc.dtype != torch.int64 or tuple(acc.shape) != (LANES, 2) or not acc.is_contiguous():
            raise ValueError(f"the accumulator must be contiguous int64 [{LANES}, 2], got {acc.dtype} "
                             f"{tuple(acc.shape)}")
        for (start, end), t in zip(spans, tensors):
            if t is not None and t.numel() * t.element_size() != end - start:
                raise ValueError(f"a {t.dtype}{list(t.shape)} tensor does not fill bucket bytes [{start}, {end})")
        if nbytes == 0 or not spans:
            return
        backend = choose_backend(flat.device, self.backend)
        if backend == "torch" or any(t is not None and not t.is_contiguous() for t in tensors):
            self._torch(direction, flat, nbytes, spans, tensors, acc, row_stride)
        else:
            self._triton(direction, flat, nbytes, spans, tensors, acc, row_stride)

    @staticmethod
    def _torch(direction, flat, nbytes, spans, tensors, acc, row_stride):
        if direction == "gather":  # the bucket's bytes as pack would leave them, in a scratch copy
            scratch = torch.zeros(nbytes, dtype=torch.uint8, device=flat.device)
            for (s, e), t in zip(spans, tensors):
                scratch[s:e] = t.contiguous().view(-1).view(torch.uint8)
            acc[0] += bucket_checksum(scratch, nbytes, row_stride)
            return
        pairs = [(flat[s:e].view(t.dtype).view(t.shape), t) for (s, e), t in zip(spans, tensors) if t is not None]
        if direction == "pack" and pairs:
            torch._foreach_copy_([v for v, _ in pairs], [t for _, t in pairs])
        acc[0] += bucket_checksum(flat, nbytes, row_stride)
        if direction == "unpack" and pairs:
            torch._foreach_copy_([t for _, t in pairs], [v for v, _ in pairs])

    def _triton(self, direction, flat, nbytes, spans, tensors, acc, row_stride):
        from redline.sync import bucket_copy_triton as kernel

        flat_ptr = flat.data_ptr()
        ptrs = tuple(t.data_ptr() if t is not None else None for t in tensors)
        key = (direction, flat.device, flat_ptr, nbytes, tuple(spans), ptrs)
        entry = self._tables.get(key)
        if entry is None:
            entry = self._table(direction, flat, spans, ptrs)
            _remember(self._tables, key, entry, _TABLE_CACHE)
        else:
            self._tables.move_to_end(key)
        table, owner, programs, unit, vec = entry
        last_row = -(-nbytes // ROW_BYTES) - 1
        base = flat[:nbytes - nbytes % unit].view(_UNIT_DTYPES[unit])
        kernel.launch(base, table, owner, acc, programs, row_stride, last_row, unit=unit, vec=vec,
                      copy=direction in ("pack", "unpack"))

    def _table(self, direction, flat, spans, ptrs):
        """The kernel's per-tensor table (see bucket_copy_triton) and its piece -> tensor map."""
        flat_ptr = flat.data_ptr()
        offsets = [flat_ptr + s for s, _ in spans] + [p for p in ptrs if p is not None]
        offsets += [x for span in spans for x in span]
        unit = next(u for u in (8, 4, 2, 1) if all(x % u == 0 for x in offsets))
        vec = 2 if unit == 8 and all(x % 16 == 0 for x in offsets) else 1
        owner, firsts = self._owner(flat.device, tuple(spans), unit)
        rows = []
        for (start, end), ptr, first in zip(spans, ptrs, firsts):
            pos = start // unit
            other = (ptr - flat_ptr) // unit if ptr is not None else pos  # distances from the flat bucket
            src, dst = (other, pos) if direction in ("pack", "gather") else (pos, other)
            rows.append([src, dst, pos, (end - start) // unit, first, int(ptr is not None)])
        return _to_device(torch.tensor(rows, dtype=torch.int64), flat.device), owner, len(owner), unit, vec

    def _owner(self, device, spans, unit):
        """Which tensor each program handles (pieces = the tensor's intersections with checksum rows)."""
        key = (device, spans, unit)
        entry = self._owners.get(key)
        if entry is None:
            row_units = ROW_BYTES // unit
            pieces = [(e // unit - 1) // row_units - (s // unit) // row_units + 1 if e > s else 0 for s, e in spans]
            firsts = [0]
            for count in pieces[:-1]:
                firsts.append(firsts[-1] + count)
            owner = torch.repeat_interleave(torch.arange(len(spans), dtype=torch.int32),
                                            torch.tensor(pieces, dtype=torch.int64))
            entry = (_to_device(owner, device), firsts)
            _remember(self._owners, key, entry, _OWNER_CACHE)
        else:
            self._owners.move_to_end(key)
        return entry


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host
    # pinned + non_blocking: no host synchronisation; the caching host allocator keeps the pinned block until
    # the copy has run.
    return host.pin_memory().to(device, non_blocking=True)


def _remember(cache: OrderedDict, key, value, limit: int) -> None:
    cache[key] = value
    if len(cache) > limit:
        cache.popitem(last=False)
