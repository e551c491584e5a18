"""The LM head's logits GEMM with its epilogue inside a warp-specialised CuTe-DSL GEMM (QuACK's sm_90 GEMMs and their
``@gemm_epilogue`` frontend, ``pip install 'redline[gpu]'``): the contracts of ``lm_head_gemm_triton``, so the
plans, the merge of the statistics and the one-pass path's dz kernel stay as they are.

``REDLINE_LM_HEAD_GEMM=cute`` selects both kernels, ``cute-dz`` the backward's alone (``backend``).
  ``gemm_stats``  forward (and the one-pass path's statistics): a prepass over each fp32 accumulator tile finds its
                  rows' max over the tile's STATS_BLOCK_N columns; the epilogue then folds ``e = exp(z − max)``
                  and ``e·(z − max)`` into per-(row, tile) sums and picks the target column's raw logit. No logits
                  are stored, unless ``offsets`` asks for them (each logit's offset from its tile's max, fp16: the
                  one-pass path's kept logits).
  ``gemm_dz``     two-pass backward: the recomputed tile becomes ``dz = p·(α + β·acc)`` with per-row α, β
                  (``dz_row_terms``); the target column's one-hot term is written afterwards from its exact fp32
                  logit, which the epilogue gathers (``fix_target_column``), so no element of the tile compares
                  column indices.
Needs an sm_90 GPU (sm_100: compiled, unmeasured, ``CONFIGS``), bf16/fp16 inputs, rows of 16-byte multiples and,
for the statistics, a vocabulary (shard) that is a multiple of STATS_BLOCK_N (a ragged last tile would add its padding's exp to the sums); ``supported`` says
which is missing. The host-side glue (``stats_into_parts``, ``dz_row_terms``, ``fix_target_column``) is plain
torch and runs on CPU tensors in the tests.
"""

import functools
import math

import torch

import triton
import triton.language as tl

from .linear_logprobs_triton import _interpreting, dz_tile
from . import lm_head_gemm_triton
from .lm_head_gemm_triton import STRIDE_ALIGN, offset_dtype  # noqa: F401  (the same contracts)

STATS_BLOCK_N = 128  # columns per statistics piece: the CuTe GEMM's tile width
LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
_LOG2E = tl.constexpr(LOG2E)  # what a Triton kernel may read of a global


@functools.lru_cache(maxsize=None)
def quack_missing() -> str | None:
    """None when the epilogues import (QuACK and CUTLASS's DSL, the pieces of QuACK they use), else why not
    (checked once per process): an ``auto`` choice never meets a QuACK that cannot build them."""
    try:
        from . import lm_head_cute_epilogues  # noqa: F401
    except Exception as exc:  # an older or newer QuACK, a DSL that fails to load: not usable, say why
        return f"QuACK's epilogue frontend is not usable ({type(exc).__name__}: {exc}); pip install 'redline[gpu]'"
    return None


def why_not(capability: tuple[int, int] | None, dtype: torch.dtype, width: int, vocab: int | None = None) -> str | None:
    """None when the CuTe kernels can run on a GPU of ``capability`` (None: CPU tensors) for ``[t, width]`` rows of
    ``dtype`` (and, given ``vocab``, the statistics over that many columns), else why not."""
    if capability is None:
        return "the CuTe-DSL GEMMs need CUDA tensors"
    if capability not in CONFIGS:
        return (f"compute capability {capability[0]}.{capability[1]} has no launch configuration for these GEMMs "
                f"(sm_90, sm_100)")
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the rows are {dtype}; the CuTe-DSL GEMMs take bf16 or fp16"
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (width * itemsize) % 16:
        return f"hidden rows of {width} × {itemsize} bytes are not a multiple of 16 (TMA)"
    if vocab is not None and vocab % STATS_BLOCK_N:
        return f"a vocabulary (shard) of {vocab} is not a multiple of {STATS_BLOCK_N} (the statistics tile)"
    return quack_missing()


def supported(hidden: torch.Tensor, vocab: int | None = None) -> str | None:
    """``why_not`` for ``hidden``'s device, dtype and width."""
    capability = torch.cuda.get_device_capability(hidden.device) if hidden.is_cuda else None
    return why_not(capability, hidden.dtype, hidden.shape[1], vocab)


# QuACK launch configurations (``EpiMod.gemm`` keywords) per compute capability. The statistics tile is
# STATS_BLOCK_N wide (a piece of the partials).
# sm_90: among the fastest that ``benchmarks/tune_cute_lm_head.py`` timed in three H100 sittings
# (``benchmarks/results/lm_head/lm-head-cute-h100/``; H=4096, V=151936; the best three of each kernel lie within
# 2–4 % of each other, about the spread between sittings). Statistics of a 5120-token chunk over the whole
# vocabulary: 8.84–9.13 ms with 256-row cooperative tiles (QuACK's plain GEMM of the block 8.44, cuBLAS's
# 8.48–9.14); dz of a 4096 × 24320 block with 128 × 192 pingpong tiles (one warp group's epilogue runs while the
# other's mainloop does): 1.08 ms for the GEMM itself, plain GEMM 1.02–1.06.
# sm_100: QuACK's own sm_100 shapes (256-row tiles over two-CTA clusters; no pingpong there), compiled on the CPU
# (``tests/kernels/cute_compile.py``), never run: ``auto`` does not take them (``MEASURED``); ``cute`` does.
CONFIGS = {
    (9, 0): {"stats": dict(tile_M=256, tile_N=STATS_BLOCK_N, cluster_M=2, cluster_N=1, pingpong=False),
             "dz": dict(tile_M=128, tile_N=192, cluster_M=2, cluster_N=1, pingpong=True)},
    (10, 0): {"stats": dict(tile_M=256, tile_N=STATS_BLOCK_N, cluster_M=2, cluster_N=1, pingpong=False),
              "dz": dict(tile_M=256, tile_N=256, cluster_M=2, cluster_N=1, pingpong=False)},
}
MEASURED = {(9, 0)}  # where REDLINE_LM_HEAD_GEMM=auto takes these GEMMs: measured faster there (H100)


def _config(kernel: str, device: torch.device) -> dict:
    return CONFIGS[torch.cuda.get_device_capability(device)][kernel]


def gemm_stats(h, weight, target, parts, inv_temp: float, offsets=None) -> None:
    """Softmax statistics of ``h [t, H]`` over ``weight [V, H]`` (``target [t]`` ids local to the shard) into
    ``parts``: five ``[t, V / STATS_BLOCK_N]`` contiguous fp32 tensors (m, s, w, zy, hit) for
    ``vocab_stats.combine``. ``offsets``: a ``[t, V]`` fp16 view (row stride a multiple of ``STRIDE_ALIGN``) that
    receives each logit's offset from its piece's max (``lm_head_gemm_triton.gemm_stats``'s contract)."""
    n_rows = h.shape[0]
    if n_rows == 0:
        return
    from .lm_head_cute_epilogues import stats
    m, s, w, _, _ = parts
    target_logit = torch.empty(n_rows, dtype=torch.float32, device=h.device)
    stats.gemm(h, weight, offsets, epi_args=dict(piece_max=STATS_BLOCK_N, piece_max_out=m, sum_exp=s,
                                                 sum_exp_offset=w, target=target.to(torch.int32),
                                                 target_logit=target_logit, inv_temp=float(inv_temp)),
               **_config("stats", h.device))
    stats_into_parts(parts, target, target_logit, weight.shape[0], inv_temp)


def stats_into_parts(parts, target, target_logit, vocab: int, inv_temp: float) -> None:
    """Turn the statistics epilogue's raw outputs, in place, into ``vocab_stats`` pieces: m holds each tile's max of
    the raw accumulator × log2(e), w the sums of e·(z − max) in log2 units, and ``target_logit [t]`` the target's
    raw logit, written only for rows whose target lies in the shard (``target [t]`` local ids in [0, vocab))."""
    m, _, w, zy, hit = parts
    m.mul_(inv_temp * LN2)
    w.mul_(LN2)
    inside = (target >= 0) & (target < vocab)
    zy.zero_()
    hit.zero_()
    zy[:, 0] = torch.where(inside, target_logit * inv_temp, 0.0)  # rows outside: never written, garbage
    hit[:, 0] = inside.to(hit.dtype)


@triton.jit
def _dz_rows_kernel(lse_ptr, ent_ptr, glp_ptr, gent_ptr, out_ptr, stride_out, n_rows, inv_temp,
                    HAS_GENT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    lse = tl.load(lse_ptr + r, mask=ok, other=0.0)
    g_lp = tl.load(glp_ptr + r, mask=ok, other=0.0)
    alpha = -inv_temp * g_lp
    beta = tl.zeros_like(g_lp)
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + r, mask=ok, other=0.0)
        alpha += inv_temp * g_ent * (lse - tl.load(ent_ptr + r, mask=ok, other=0.0))
        beta = -inv_temp * inv_temp * g_ent
    tl.store(out_ptr + r, lse * _LOG2E, mask=ok)
    tl.store(out_ptr + stride_out + r, alpha, mask=ok)
    tl.store(out_ptr + 2 * stride_out + r, beta, mask=ok)


ROWS_BLOCK = 16 if _interpreting() else 1024


def dz_row_terms(row_values, inv_temp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse·log2(e), α, β)`` ``[1, t]`` fp32 of ``dz = (1/τ)·[g_lp·(onehot − p) − g_H·p·(z − Σp z)]`` written
    as ``p·(α + β·acc)`` off the target column, acc the raw logit (z = acc/τ): α = −(g_lp − g_H·Σp z)/τ,
    β = −g_H/τ². ``row_values``: ``(lse, entropy, g_lp, g_H or None)``, each ``[t]`` fp32 contiguous. One launch."""
    lse, entropy, grad_logp, grad_entropy = row_values
    n_rows = lse.numel()
    out = torch.empty(3, -(-n_rows // 4) * 4, dtype=torch.float32, device=lse.device)  # 16-byte aligned rows (TMA)
    _dz_rows_kernel[(triton.cdiv(n_rows, ROWS_BLOCK),)](
        lse, entropy, grad_logp, grad_entropy if grad_entropy is not None else grad_logp, out, out.stride(0), n_rows,
        inv_temp, HAS_GENT=grad_entropy is not None, BLOCK=ROWS_BLOCK)
    return out[0:1, :n_rows], out[1:2, :n_rows], out[2:3, :n_rows]


@triton.jit
def _fix_target_kernel(dz_ptr, stride_dz, n_rows, n_cols, y_ptr, col0, zy_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
                       inv_temp, HAS_GENT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(y_ptr + r, mask=r < n_rows, other=-1) - col0
    inside = (r < n_rows) & (local >= 0) & (local < n_cols)
    # each row's target column as a one-column tile: column 0 is the target id of every row inside the block
    z = tl.load(zy_ptr + r, mask=inside, other=0.0)[:, None] * inv_temp
    dz = dz_tile(z, tl.zeros((1,), tl.int32), r, inside, y_ptr, col0 + local, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
                 inv_temp, HAS_GENT)
    tl.store(dz_ptr + r.to(tl.int64) * stride_dz + local, tl.sum(dz, axis=1).to(dz_ptr.dtype.element_ty), mask=inside)


def fix_target_column(dz, target, col0: int, target_logit, row_values, inv_temp: float) -> None:
    """Overwrite each row's target entry of ``dz [t, vc]`` (unit column stride; columns col0…col0+vc−1; ``target
    [t]`` local ids) with its exact value, one-hot term included, from ``target_logit [t]`` fp32 (the raw logit the
    dz epilogue gathered; garbage in rows whose target lies outside the block, which keep their entry). One launch,
    no host sync."""
    lse, entropy, grad_logp, grad_entropy = row_values
    n_rows = dz.shape[0]
    _fix_target_kernel[(triton.cdiv(n_rows, ROWS_BLOCK),)](
        dz, dz.stride(0), n_rows, dz.shape[1], target, col0, target_logit, lse, entropy, grad_logp,
        grad_entropy if grad_entropy is not None else grad_logp, inv_temp, HAS_GENT=grad_entropy is not None,
        BLOCK=ROWS_BLOCK)


def dz_from_offsets(offsets, piece_max, dz, target, col0: int, row_values, inv_temp: float) -> None:
    """``lm_head_gemm_triton.dz_from_offsets`` over this module's statistics pieces (STATS_BLOCK_N columns)."""
    lm_head_gemm_triton.dz_from_offsets(offsets, piece_max, dz, target, col0, row_values, inv_temp,
                                        piece=STATS_BLOCK_N)


def gemm_dz(h, w_chunk, dz, target, col0: int, row_values, inv_temp: float) -> None:
    """Write ``dz [t, vc]`` (a view whose row stride is a multiple of ``STRIDE_ALIGN``) for ``h [t, H]`` and
    ``w_chunk [vc, H]`` (contiguous rows). ``target [t]`` int64 ids (local to the shard), ``row_values``:
    ``(lse, entropy, grad_logp, grad_entropy or None)``, each ``[t]`` fp32 contiguous."""
    n_rows, n_cols = dz.shape
    if n_rows == 0 or n_cols == 0:
        return
    from .lm_head_cute_epilogues import dz as dz_epilogue
    lse_log2, alpha, beta = dz_row_terms(row_values, inv_temp)
    target_logit = torch.empty(n_rows, dtype=torch.float32, device=h.device)
    dz_epilogue.gemm(h, w_chunk, dz, epi_args=dict(lse_log2=lse_log2, alpha=alpha, beta=beta,
                                                   scale_log2=float(inv_temp * LOG2E),
                                                   target=target - col0,
                                                   target_logit=target_logit),
                     **_config("dz", h.device))
    fix_target_column(dz, target, col0, target_logit, row_values, inv_temp)
