"""Tune the LM head's autotuned Triton GEMMs for every key a run can reach, before the run needs them.

``reachable(...)`` names, per kernel that ``REDLINE_LM_HEAD_GEMM`` lets run on this GPU, the tuning keys and one
block shape per integer class of each (``tuning_buckets``); ``tune(weight, reachable)`` runs each kernel once per
block shape on random rows and the real weight, so the autotuner times its configs there (a key already seeded
from the table, ``tuning_table.apply``, is not timed again) and Triton compiles the chosen config for each class.
``AUTOTUNED`` maps the names used in the table to the autotuned kernels. CUDA only.
"""

import torch

from . import lm_head_gemm_triton as gemm
from .backend import LM_HEAD_GEMM_AUTO, LM_HEAD_GEMM_KERNELS, lm_head_gemm
from .linear_logprobs_triton import (ALIGN, AUTO_DZ_CAPABILITY, AUTO_DZ_MIN_ROWS, POLICY_LOSS_WORKSPACE_BYTES,
                                     WORKSPACE_BYTES)
from .lm_head_plan import round_up
from .tuning_buckets import dz_tuning_shapes, stats_tuning_shapes

AUTOTUNED = {"gemm_dz": gemm._gemm_dz_kernel, "gemm_stats": gemm._gemm_stats_kernel}
BUDGETS = (WORKSPACE_BYTES, POLICY_LOSS_WORKSPACE_BYTES)  # log-prob op's and policy loss's default workspaces


def reachable(max_rows: int, vocab: int, width: int, dtype: torch.dtype, capability: tuple[int, int] | None):
    """``{kernel name: {(rows bucket, cols bucket): [(rows, cols), ...]}}`` for calls of up to ``max_rows``
    selected rows on a ``[vocab, width]`` weight shard of ``dtype`` on a GPU of ``capability``: empty where
    ``REDLINE_LM_HEAD_GEMM`` runs no Triton GEMM (``auto`` below ``AUTO_DZ_MIN_ROWS`` rows, or off Hopper)."""
    choice = lm_head_gemm()
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (width * itemsize) % 16 or capability is None or capability < (9, 0):
        return {}
    if choice == LM_HEAD_GEMM_AUTO:
        kernels, min_dz_rows = (("dz",), AUTO_DZ_MIN_ROWS) if capability == AUTO_DZ_CAPABILITY else ((), 0)
    else:
        kernels, min_dz_rows = LM_HEAD_GEMM_KERNELS[choice], 1
    found = {}
    if "dz" in kernels and max_rows >= min_dz_rows:
        found["gemm_dz"] = dz_tuning_shapes(min_dz_rows, max_rows, vocab, width, itemsize, BUDGETS, ALIGN)
    if "stats" in kernels:
        found["gemm_stats"] = stats_tuning_shapes(max_rows, vocab, width, itemsize, BUDGETS,
                                                  POLICY_LOSS_WORKSPACE_BYTES, ALIGN, gemm.STATS_BLOCK_N)
    return {name: keys for name, keys in found.items() if keys}


def tune(weight: torch.Tensor, shapes: dict, progress=None) -> int:
    """Run each kernel of ``shapes`` (``reachable``'s form) once per block shape on ``weight [V, H]`` (read only)
    with random rows, both variants of its flags; returns the number of block shapes run. ``progress(done,
    total, text)`` is called before each."""
    generator = torch.Generator(device=weight.device).manual_seed(0)
    blocks = [(name, shape) for name, keys in shapes.items() for per_key in keys.values() for shape in per_key]
    if not blocks:
        return 0
    for done, (name, (rows, cols)) in enumerate(blocks):
        if progress:
            progress(done, len(blocks), f"{name} {rows}×{cols}")
        h = torch.randn(rows, weight.shape[1], generator=generator, device=weight.device).to(weight.dtype)
        target = torch.randint(0, cols, (rows,), generator=generator, device=weight.device)
        if name == "gemm_dz":
            _run_dz(h, weight[:cols], target)
        else:
            _run_stats(h, weight, target)
    torch.cuda.synchronize(weight.device)
    return len(blocks)


def _run_dz(h, w_chunk, target) -> None:
    rows, cols = h.shape[0], w_chunk.shape[0]
    dz = torch.empty(rows, round_up(cols, gemm.STRIDE_ALIGN), dtype=h.dtype, device=h.device)[:, :cols]
    row = torch.zeros(rows, dtype=torch.float32, device=h.device)
    for grad_entropy in (None, row):  # HAS_GENT compiles apart
        gemm.gemm_dz(h, w_chunk, dz, target, 0, (row, row, row, grad_entropy), 1.0)


def _run_stats(h, weight, target) -> None:
    rows, vocab = h.shape[0], weight.shape[0]
    pieces = -(-vocab // gemm.STATS_BLOCK_N)
    parts = torch.empty(5, rows, pieces, dtype=torch.float32, device=h.device)
    gemm.gemm_stats(h, weight, target, parts, 1.0)
    stride = round_up(vocab, gemm.STRIDE_ALIGN)
    if rows * stride * 2 <= POLICY_LOSS_WORKSPACE_BYTES:  # KEEP_OFFSETS: the one-pass loss's blocks, which fit it
        kept = torch.empty(rows, stride, dtype=gemm.offset_dtype(h.dtype), device=h.device)[:, :vocab]
        gemm.gemm_stats(h, weight, target, parts, 1.0, offsets=kept)
