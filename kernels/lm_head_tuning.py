"""Tune the LM head's autotuned Triton GEMMs for every key a run can reach, before the run needs them.

``reachable(...)`` names, per kernel that ``REDLINE_LM_HEAD_GEMM`` lets run on this GPU, the tuning keys and one
block shape per integer class of each (``tuning_buckets``); ``tune(weight, reachable)`` runs each kernel once per
block shape on random rows and the real weight, so the autotuner times its configs there (a key already seeded
from the table, ``tuning_table.apply``, is not timed again) and Triton compiles the chosen config for each class.
``AUTOTUNED`` maps the names used in the table to the autotuned kernels. With ``REDLINE_LM_HEAD_GEMM=cute`` (or
``cute-dz``) the same runs compile QuACK's kernels and build their launch plans instead (they are not autotuned).
CUDA only.
"""

import torch

from . import lm_head_gemm_triton
from .backend import LM_HEAD_GEMM_AUTO, LM_HEAD_GEMM_KERNELS, lm_head_gemm
from .linear_logprobs_triton import (ALIGN, AUTO_DZ_MIN_ROWS, POLICY_LOSS_WORKSPACE_BYTES, WORKSPACE_BYTES, auto_gemm,
                                     fused_gemm)
from .lm_head_plan import round_up
from .tuning_buckets import dz_tuning_shapes, stats_tuning_shapes

AUTOTUNED = {"gemm_dz": lm_head_gemm_triton._gemm_dz_kernel, "gemm_stats": lm_head_gemm_triton._gemm_stats_kernel}
BUDGETS = (WORKSPACE_BYTES, POLICY_LOSS_WORKSPACE_BYTES)  # log-prob op's and policy loss's default workspaces


def reachable(max_rows: int, vocab: int, width: int, dtype: torch.dtype, capability: tuple[int, int] | None):
    """``{kernel name: {(rows bucket, cols bucket): [(rows, cols), ...]}}`` for calls of up to ``max_rows``
    selected rows on a ``[vocab, width]`` weight shard of ``dtype`` on a GPU of ``capability``: empty where
    ``REDLINE_LM_HEAD_GEMM`` runs no fused GEMM (``auto`` off Hopper, or with the Triton dz GEMM alone below
    ``AUTO_DZ_MIN_ROWS`` rows)."""
    choice = lm_head_gemm()
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (width * itemsize) % 16 or capability is None or capability < (9, 0):
        return {}
    if choice == LM_HEAD_GEMM_AUTO:
        chosen = {kernel: auto_gemm(kernel, capability, dtype, width, vocab, max_rows, None)
                  for kernel in ("stats", "dz")}
        kernels = tuple(kernel for kernel, gemm in chosen.items() if gemm)
        min_dz_rows = AUTO_DZ_MIN_ROWS if chosen["dz"] == "triton-dz" else 1
    else:
        kernels, min_dz_rows = LM_HEAD_GEMM_KERNELS[choice], 1
    found = {}
    if "dz" in kernels and max_rows >= min_dz_rows:
        found["gemm_dz"] = dz_tuning_shapes(min_dz_rows, max_rows, vocab, width, itemsize, BUDGETS, ALIGN)
    if "stats" in kernels:
        found["gemm_stats"] = stats_tuning_shapes(max_rows, vocab, width, itemsize, BUDGETS,
                                                  POLICY_LOSS_WORKSPACE_BYTES, ALIGN, lm_head_gemm_triton.STATS_BLOCK_N)
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


def _fused_module(h, kernel: str, vocab: int):
    """The module whose ``kernel`` (``"stats"`` over ``vocab`` columns, ``"dz"``) the op runs on rows like ``h`` in
    the calls ``reachable`` lists (``auto``: calls of at least AUTO_DZ_MIN_ROWS rows, where its dz choice is made)."""
    module = fused_gemm(h, kernel, AUTO_DZ_MIN_ROWS, vocab)
    if module is None:
        raise ValueError(f"no fused {kernel} GEMM runs on {h.dtype} rows of {h.shape[1]} here: "
                         f"reachable() lists none to tune")
    return module


def _run_dz(h, w_chunk, target) -> None:
    gemm = _fused_module(h, "dz", w_chunk.shape[0])
    rows, cols = h.shape[0], w_chunk.shape[0]
    dz = torch.empty(rows, round_up(cols, gemm.STRIDE_ALIGN), dtype=h.dtype, device=h.device)[:, :cols]
    row = torch.zeros(rows, dtype=torch.float32, device=h.device)
    for grad_entropy in (None, row):  # HAS_GENT compiles apart
        gemm.gemm_dz(h, w_chunk, dz, target, 0, (row, row, row, grad_entropy), 1.0)


def _run_stats(h, weight, target) -> None:
    gemm = _fused_module(h, "stats", weight.shape[0])
    rows, vocab = h.shape[0], weight.shape[0]
    pieces = -(-vocab // gemm.STATS_BLOCK_N)
    parts = torch.empty(5, rows, pieces, dtype=torch.float32, device=h.device)
    gemm.gemm_stats(h, weight, target, parts, 1.0)
    stride = round_up(vocab, gemm.STRIDE_ALIGN)
    if rows * stride * 2 <= POLICY_LOSS_WORKSPACE_BYTES:  # KEEP_OFFSETS: the one-pass loss's blocks, which fit it
        kept = torch.empty(rows, stride, dtype=gemm.offset_dtype(h.dtype), device=h.device)[:, :vocab]
        gemm.gemm_stats(h, weight, target, parts, 1.0, offsets=kept)
