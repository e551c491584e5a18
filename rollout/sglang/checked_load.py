"""Loading a weight bucket inside an SGLang server and checksumming what its parameters hold afterwards.

An SGLang server started with ``--custom-weight-loader LOADER`` (redline adds it to the servers it launches)
runs ``load_bucket(model, named_tensors)`` in its scheduler process for each ``/update_weights_from_tensor``
whose ``load_format`` is ``LOADER``. The payload (``redline.rollout.sglang.payload.CheckedPacker``) is one
CUDA-IPC tensor in the trainer's memory, ``[(header, flat)]``: ``flat`` holds the bucket's bytes, then (8-byte
aligned) one result slot of ``RESULT_WORDS`` int64 per server; ``header`` is ``HEADER`` + JSON ``{"nbytes",
"row_stride", "result": byte offset of this server's slot, "tensors": [[HF name, dtype, shape, start, end,
SGLang parameter, byte offset in it], ...]}`` (``encode_header``). One allocation, one IPC handle to open.

The server loads the bucket's tensors with the model's own ``load_weights`` (whatever SGLang does on load
happens), then computes, in one launch, the checksum (``redline.sync.checksum``, every ``row_stride``-th row)
that the bucket's bytes would have if they were read back out of its parameters at the header's places
(``BucketCopier.gather_checksum``), writes ``[plain, weighted, 0, 0]`` into its slot and waits for its stream,
so the answer comes after the result and every copy out of the bucket have landed. The trainer compares with
the checksum it took while packing: the whole path, from its tensors to the server's parameters, is checked,
at a sampled read of the parameters instead of SGLang's ``/weights_checker`` hash of every byte of the model.

A tensor the server cannot place writes ``[0, 0, index + 1, reason]`` (``REASONS``); a loader failure is logged
to the server's log and reported the same way instead of raised, so the server keeps serving. The trainer packs
each slot as ``[0, 0, UNWRITTEN, 0]``: a slot still so after the answer was not written into the trainer's buffer
(a server on another GPU loads a copy of the payload, or one it could not read as a redline bucket, which is
logged and left alone). Engine TP = 1.
"""

from __future__ import annotations

import json
import logging

import torch

LOADER = "redline.rollout.sglang.checked_load.load_bucket"
HEADER = "redline-checked-bucket:"
RESULT_WORDS = 4  # plain, weighted, index + 1 of a tensor the server could not check (0: none), reason
UNWRITTEN = -1  # the status word of a slot as the trainer packs it, until a server writes its result
REASONS = {1: "the server has no parameter of that name", 2: "its bytes lie outside that parameter",
           3: "that parameter has another dtype", 4: "the loader failed (the server's log says why)"}
LOADER_FAILED = 4

_logger = logging.getLogger(__name__)
_copier = None


def encode_header(nbytes: int, row_stride: int, result: int,
                  tensors: list[tuple[str, torch.dtype, tuple[int, ...], int, int, str, int]]) -> str:
    """The header name of a bucket: ``result`` is the byte offset of the server's result slot in the flat
    tensor; ``tensors`` rows are (HF name, dtype, shape, start, end, SGLang parameter, byte offset in it), spans
    in bytes of the flat bucket."""
    rows = [[n, str(d).removeprefix("torch."), list(s), a, b, p, o] for n, d, s, a, b, p, o in tensors]
    return HEADER + json.dumps({"nbytes": nbytes, "row_stride": row_stride, "result": result, "tensors": rows})


def decode_header(name: str) -> dict:
    if not name.startswith(HEADER):
        raise ValueError(f"{LOADER} got a payload whose name is not a redline bucket header: {name[:80]!r}")
    return json.loads(name[len(HEADER):])


def result_slot(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """The ``RESULT_WORDS`` int64 at byte ``offset`` of the flat uint8 tensor."""
    return flat[offset:offset + RESULT_WORDS * 8].view(torch.int64)


def load_bucket(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom-loader entry point (see the module docstring). Once the header names the result slot it
    never raises: what went wrong is written into the slot."""
    try:
        if len(named_tensors) != 1:
            raise ValueError(f"{LOADER} takes one (header, flat bucket) pair, got {len(named_tensors)} tensors; "
                             "was this payload packed by redline's CheckedPacker?")
        [(header_name, flat)] = named_tensors
        header = decode_header(header_name)
        result = result_slot(flat, header["result"])
    except Exception:  # raised here it would stop the server's scheduler; the trainer finds its slot unwritten
        _logger.exception("%s: a payload that is not a redline bucket was left alone", LOADER)
        return
    try:
        views = [(name, flat[start:end].view(getattr(torch, dtype)).view(shape))
                 for name, dtype, shape, start, end, _, _ in header["tensors"]]
        model.load_weights(views)
        found = _checksum_parameters(model, flat, header)
    except Exception:
        _logger.exception("%s: loading or checking a bucket failed", LOADER)
        found = torch.tensor([0, 0, 0, LOADER_FAILED], dtype=torch.int64)
    result.copy_(found.to(result.device))
    if result.is_cuda:
        torch.cuda.current_stream(result.device).synchronize()


def _checksum_parameters(model: torch.nn.Module, flat: torch.Tensor, header: dict) -> torch.Tensor:
    """``[plain, weighted, 0, 0]`` of the bucket as read back out of the parameters, or ``[0, 0, i + 1, reason]``
    for the first tensor ``i`` that cannot be read back."""
    from redline.sync.bucket_copy import BucketCopier
    from redline.sync.checksum import fold, new_accumulator

    global _copier
    parameters = dict(model.named_parameters())
    spans, regions = [], []
    for index, (_, dtype, _, start, end, engine_name, offset) in enumerate(header["tensors"]):
        parameter = parameters.get(engine_name)
        if parameter is None:
            return _unplaced(index, 1)
        if parameter.dtype != getattr(torch, dtype):
            return _unplaced(index, 3)
        data = parameter.detach().reshape(-1).view(torch.uint8)
        if offset + end - start > data.numel():
            return _unplaced(index, 2)
        spans.append((start, end))
        regions.append(data[offset:offset + end - start])
    _copier = _copier or BucketCopier()
    acc = new_accumulator(1, flat.device)
    _copier.gather_checksum(flat, header["nbytes"], spans, regions, acc[0], header["row_stride"])
    return torch.cat([fold(acc)[0], torch.zeros(2, dtype=torch.int64, device=flat.device)])


def _unplaced(index: int, reason: int) -> torch.Tensor:
    return torch.tensor([0, 0, index + 1, reason], dtype=torch.int64)


def describe(status: int, reason: int, names: list[str]) -> str:
    """What a result's status words say, for an error message."""
    if reason == LOADER_FAILED:
        return REASONS[LOADER_FAILED]
    return f"{names[status - 1]}: {REASONS.get(reason, f'unknown reason {reason}')}"
