"""The LM head's logits GEMM with its epilogue in one Triton kernel: persistent TMA GEMMs whose fp32 tiles never
leave registers.

``REDLINE_LM_HEAD_GEMM=triton`` selects both, ``triton-dz`` the backward's alone, and the default ``auto`` the
backward's where it measured faster (``linear_logprobs_triton.auto_fused_dz``); ``cublas`` has cuBLAS write each
fp32 logits block to the workspace and a Triton kernel read it back (8 bytes of HBM traffic per logit).
  ``gemm_stats``  forward: each ``[BLOCK_M, STATS_BLOCK_N]`` tile of ``h Wᵀ / τ`` is folded into the softmax
                  statistics of its rows over its columns (``vocab_stats``: max, Σexp, Σexp·(z − max), target
                  logit, hit), written as one piece of ``[5, rows, V / STATS_BLOCK_N]`` partials, which
                  ``vocab_stats.combine`` merges: 20 bytes per row and 128 columns instead of 8 per logit.
  ``gemm_dz``     two-pass backward: the recomputed tile becomes
                  ``dz = (1/τ)·[g_lp·(onehot − p) − g_H·p·(z − Σp z)]`` in the input dtype: per logit 2 bytes
                  instead of 4 written + 4 read + 2 written, and the workspace holds dz alone, so vocab chunks
                  are ~3× longer (fewer read-modify-writes of the fp32 dh accumulator).

Whether it beats cuBLAS + epilogue depends on this GEMM reaching cuBLAS's throughput
(``benchmarks/bench_lm_head.py`` runs both side by side). On the H100 at H=4096, V=151936, T=16384
``gemm_stats`` ran the forward in 39.6 ms against 36.3 for cuBLAS + ``_stats_kernel``, and ``gemm_dz`` the
fwd+bwd in 131.8 against 136.1 ms (``benchmarks/results/lm_head/lm-head-h100-{fused-gemms,triton-dz}.md``).
Needs TMA (compute capability ≥ 9.0) and rows of 16-byte multiples (H·itemsize); the dz block's row stride is
padded to 8 elements for the same reason. On CPU tensors it runs in Triton's interpreter (tests).
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .linear_logprobs_triton import dz_tile
from .tuning_buckets import bucket

STRIDE_ALIGN = 8  # elements: TMA wants 16-byte row strides (bf16/fp16; fp32 rows need 4)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _set_dz_blocks(nargs) -> None:
    """Autotuner pre-hook: the descriptors' blocks follow the config being run."""
    m, n, k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["h_desc"].block_shape = [m, k]
    nargs["w_desc"].block_shape = [n, k]
    nargs["dz_desc"].block_shape = [m, n]


def _dz_configs():
    if _interpreting():
        return [triton.Config(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2), num_warps=1,
                              pre_hook=_set_dz_blocks)]
    # Hopper bf16 GEMM tiles that fit the SM's shared memory; the autotuner keeps the fastest per (rows,
    # columns, width) of a block. Compiled for sm_90 (Triton 3.9, ptxas): 128×128 with 8 warps uses 251–254
    # registers and spills nothing; 128×256 spills 120 bytes a thread but moves half the W traffic per FLOP.
    return [triton.Config(dict(BLOCK_M=128, BLOCK_N=n, BLOCK_K=64, GROUP_M=8), num_stages=s, num_warps=8,
                          pre_hook=_set_dz_blocks) for n, s in ((128, 4), (128, 5), (256, 3))]


def _set_stats_blocks(nargs) -> None:
    nargs["h_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs["KEEP_OFFSETS"]:
        nargs["off_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_N"]]


def _stats_configs():
    if _interpreting():
        return [triton.Config(dict(BLOCK_M=16, BLOCK_K=16, GROUP_M=2), num_warps=1, pre_hook=_set_stats_blocks)]
    # 128×128 tiles, 8 warps: the statistics epilogue's reductions keep several tile-sized values live; compiled
    # for sm_90 this spills 56 bytes a thread, where 128×256 tiles spilled 800
    return [triton.Config(dict(BLOCK_M=128, BLOCK_K=64, GROUP_M=8), num_stages=s, num_warps=8,
                          pre_hook=_set_stats_blocks) for s in (4, 5)]


def tuning_key(n: int) -> int:
    """The autotuners' key for a row or column count: its power-of-two bucket. Keyed by the exact count, every new
    batch size in an RL run (and every token chunk's tail) would time all configs again, each time holding
    ``do_bench``'s 256 MB cache-flush buffer beside the op's workspace. Which keys a run reaches:
    ``tuning_buckets``; their choices persist across runs in ``tuning_table``."""
    return bucket(n)


# columns per statistics piece: fixed across the autotuner's configs, since the partials' layout depends on it
STATS_BLOCK_N = 16 if _interpreting() else 128


@triton.jit
def _tile_of(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """(m, n) of tile number ``tile`` in GROUP_M-row bands, m fastest: tiles in flight share a few row tiles of h
    and a few column tiles of W, which stay in L2."""
    per_band = GROUP_M * n_n
    first_m = tile // per_band * GROUP_M
    rows_in_band = tl.minimum(n_m - first_m, GROUP_M)
    local = tile % per_band
    return first_m + local % rows_in_band, local // rows_in_band


@triton.jit
def _logits_tile(h_desc, w_desc, tile, n_m, n_n, width, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile number ``tile`` (``_tile_of``) of ``h · Wᵀ``: ``(acc, pid_m, pid_n, rows, cols)``, the fp32
    ``[BLOCK_M, BLOCK_N]`` product (TMA loads feeding the tensor cores), the tile's coordinates and its row and
    column indices."""
    pid_m, pid_n = _tile_of(tile, n_m, n_n, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        a = h_desc.load([pid_m * BLOCK_M, k0])
        b = w_desc.load([pid_n * BLOCK_N, k0])
        if UPCAST:  # the interpreter multiplies bf16 incorrectly; fp32 products of bf16 values are exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc, pid_m, pid_n, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.autotune(configs=_dz_configs(), key=["rows_key", "cols_key", "width"])
@triton.jit
def _gemm_dz_kernel(h_desc, w_desc, dz_desc, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
                    n_rows, n_cols, width, inv_temp, rows_key, cols_key, NUM_PROGRAMS: tl.constexpr,
                    HAS_GENT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """dz ``[n_rows, n_cols]`` of ``h [n_rows, width] · W_vᵀ`` (``W_v [n_cols, width]``; its first row is vocab id
    col0 of y's ids); lse, entropy, g_lp, g_H ``[n_rows]`` fp32. Persistent: NUM_PROGRAMS programs stride over
    the tiles."""
    n_m = tl.cdiv(n_rows, BLOCK_M)
    n_n = tl.cdiv(n_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=True):
        acc, pid_m, pid_n, r, cols = _logits_tile(h_desc, w_desc, tile, n_m, n_n, width, PRECISION, UPCAST,
                                                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        dz = dz_tile(acc * inv_temp, cols, r, r < n_rows, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
                     inv_temp, HAS_GENT)
        dz_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], dz.to(dz_desc.dtype))


@triton.autotune(configs=_stats_configs(), key=["rows_key", "cols_key", "width"])
@triton.jit
def _gemm_stats_kernel(h_desc, w_desc, off_desc, y_ptr, m_ptr, s_ptr, w_out_ptr, zy_ptr, hit_ptr, n_rows, n_cols,
                       width, inv_temp, rows_key, cols_key, NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, KEEP_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Softmax statistics of ``h [n_rows, width] · Wᵀ / τ`` (``W [n_cols, width]``, y: each row's target id)
    per BLOCK_N columns: piece ``j`` of row ``r`` goes to ``[r, j]`` of the ``[n_rows, cdiv(n_cols, BLOCK_N)]``
    outputs. With KEEP_OFFSETS, each logit also goes to ``off_desc`` ``[n_rows, n_cols]`` (fp16 or fp32) as its
    offset from its piece's max (≤ 0), from which ``_dz_from_offsets_kernel`` rebuilds it."""
    n_m = tl.cdiv(n_rows, BLOCK_M)
    n_n = tl.cdiv(n_cols, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=True):
        acc, pid_m, pid_n, r, cols = _logits_tile(h_desc, w_desc, tile, n_m, n_n, width, PRECISION, UPCAST,
                                                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
        row_ok = r < n_rows
        col_ok = (cols < n_cols)[None, :]
        z = tl.where(col_ok, acc * inv_temp, float("-inf"))
        m = tl.max(z, axis=1)
        shifted = tl.where(col_ok, z - m[:, None], 0.0)
        e = tl.where(col_ok, tl.exp(shifted), 0.0)
        target = tl.load(y_ptr + r, mask=row_ok, other=-1)
        is_target = (cols[None, :] == target[:, None]) & col_ok
        out = r.to(tl.int64) * n_n + pid_n
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(s_ptr + out, tl.sum(e, axis=1), mask=row_ok)
        tl.store(w_out_ptr + out, tl.sum(e * shifted, axis=1), mask=row_ok)
        tl.store(zy_ptr + out, tl.sum(tl.where(is_target, z, 0.0), axis=1), mask=row_ok)
        tl.store(hit_ptr + out, tl.sum(is_target.to(tl.float32), axis=1), mask=row_ok)
        if KEEP_OFFSETS:
            off_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], shifted.to(off_desc.dtype))


@triton.jit
def _dz_from_offsets_kernel(off_ptr, stride_off, m_ptr, n_pieces, dz_ptr, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr,
                            gent_ptr, n_rows, n_cols, inv_temp, PIECE: tl.constexpr, HAS_GENT: tl.constexpr,
                            TILE_R: tl.constexpr, TILE_V: tl.constexpr):
    """dz ``[n_rows, n_cols]`` (contiguous, input dtype) of vocabulary columns col0…col0+n_cols−1, each logit rebuilt
    as its piece's max (``m [n_rows, n_pieces]``, one per PIECE columns) plus its offset (``off``, row stride
    ``stride_off``, indexed by vocabulary column)."""
    r = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(1) * TILE_V + tl.arange(0, TILE_V)
    row_ok = r < n_rows
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    column = col0 + cols
    offset = tl.load(off_ptr + r[:, None] * stride_off + column[None, :], mask=ok, other=0.0).to(tl.float32)
    piece_max = tl.load(m_ptr + r[:, None] * n_pieces + (column // PIECE)[None, :], mask=ok, other=0.0)
    dz = dz_tile(piece_max + offset, cols, r, row_ok, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp,
                 HAS_GENT)
    tl.store(dz_ptr + r[:, None] * n_cols + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


def offset_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the one-pass path keeps its logits' offsets in: fp16 for bf16/fp16 inputs (the offsets are ≤ 0 and
    small where it matters: fp16 rounds them to 2⁻¹¹ relative, finer than the bf16 dz they feed), fp32 for fp32
    inputs."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def gemm_stats(h, weight, target, parts, inv_temp: float, offsets=None) -> None:
    """Softmax statistics of ``h [t, H]`` over ``weight [V, H]`` (``target [t]`` ids local to the shard) into
    ``parts``: five ``[t, cdiv(V, STATS_BLOCK_N)]`` contiguous fp32 tensors (m, s, w, zy, hit), one piece per
    STATS_BLOCK_N columns, for ``vocab_stats.combine``. ``offsets``: a ``[t, V]`` view in ``offset_dtype`` (row
    stride a multiple of ``STRIDE_ALIGN``) that receives each logit's offset from its piece's max, for
    ``dz_from_offsets`` (the one-pass path keeps its logits that way: 2 bytes each from bf16 inputs)."""
    n_rows, n_cols = h.shape[0], weight.shape[0]
    h_desc, w_desc, *off_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1])
                                 for t in (h, weight) + (() if offsets is None else (offsets,)))
    programs = n_programs(h.device)
    upcast = _interpreting() and h.dtype != torch.float32
    _gemm_stats_kernel[(programs,)](h_desc, w_desc, off_desc[0] if off_desc else w_desc, target, *parts, n_rows,
                                    n_cols, h.shape[1], inv_temp, tuning_key(n_rows), tuning_key(n_cols),
                                    NUM_PROGRAMS=programs,
                                    PRECISION=_precision(h.dtype, upcast), UPCAST=upcast,
                                    KEEP_OFFSETS=offsets is not None, BLOCK_N=STATS_BLOCK_N)


# rows × columns per program of _dz_from_offsets_kernel (4 warps): 32×256 spilled 232 bytes a thread compiled for
# sm_90, 16×256 nothing
OFFSETS_TILE = (8, 16) if _interpreting() else (16, 256)


def dz_from_offsets(offsets, piece_max, dz, target, col0: int, row_values, inv_temp: float,
                    piece: int = STATS_BLOCK_N) -> None:
    """dz ``[t, vc]`` (contiguous, input dtype) of vocabulary columns col0…col0+vc−1 from the one-pass path's kept
    logits: ``offsets [t, V]`` (``offset_dtype``) and ``piece_max [t, cdiv(V, piece)]`` fp32 (``gemm_stats``'s m,
    one per ``piece`` columns: the statistics GEMM's piece width). ``row_values`` as ``gemm_dz``'s."""
    lse, entropy, grad_logp, grad_entropy = row_values
    n_rows, n_cols = dz.shape
    tile_r, tile_v = OFFSETS_TILE
    grid = (triton.cdiv(n_rows, tile_r), triton.cdiv(n_cols, tile_v))
    _dz_from_offsets_kernel[grid](offsets, offsets.stride(0), piece_max, piece_max.shape[1], dz, target, col0, lse,
                                  entropy, grad_logp, grad_entropy if grad_entropy is not None else grad_logp,
                                  n_rows, n_cols, inv_temp, PIECE=piece, HAS_GENT=grad_entropy is not None,
                                  TILE_R=tile_r, TILE_V=tile_v, num_warps=4)


def _precision(dtype: torch.dtype, upcast: bool) -> str:
    # fp32 inputs ask for an exact product (Triton's default for fp32 dots is tf32); so do the interpreter's
    # upcast bf16/fp16 tiles
    return "ieee" if dtype == torch.float32 or upcast else "tf32"


def supported(hidden: torch.Tensor, vocab: int | None = None) -> str | None:
    """None when the fused kernels can run on ``hidden``'s device and width (any ``vocab``), else why not."""
    if (hidden.shape[1] * hidden.element_size()) % 16:
        return f"hidden rows of {hidden.shape[1]} × {hidden.element_size()} bytes are not a multiple of 16 (TMA)"
    if hidden.is_cuda and torch.cuda.get_device_capability(hidden.device) < (9, 0):
        return f"{torch.cuda.get_device_name(hidden.device)} has no TMA (needs compute capability 9.0 or newer)"
    return None


def gemm_dz(h, w_chunk, dz, target, col0: int, row_values, inv_temp: float) -> None:
    """Write ``dz [t, vc]`` (a view whose row stride is a multiple of ``STRIDE_ALIGN``) for ``h [t, H]`` and
    ``w_chunk [vc, H]`` (contiguous rows). ``target [t]`` int64 ids (local to the shard), ``row_values``:
    ``(lse, entropy, grad_logp, grad_entropy or None)``, each ``[t]`` fp32 contiguous."""
    lse, entropy, grad_logp, grad_entropy = row_values
    n_rows, n_cols = dz.shape
    if n_rows == 0 or n_cols == 0:
        return
    # block shapes are set per config by the autotuner's pre-hook (_set_dz_blocks)
    h_desc, w_desc, dz_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1])
                               for t in (h, w_chunk, dz))
    programs = n_programs(h.device)
    upcast = _interpreting() and h.dtype != torch.float32
    precision = _precision(h.dtype, upcast)
    _gemm_dz_kernel[(programs,)](h_desc, w_desc, dz_desc, target, col0, lse, entropy, grad_logp,
                                 grad_entropy if grad_entropy is not None else grad_logp, n_rows, n_cols,
                                 h.shape[1], inv_temp, tuning_key(n_rows), tuning_key(n_cols),
                                 NUM_PROGRAMS=programs, HAS_GENT=grad_entropy is not None,
                                 PRECISION=precision, UPCAST=upcast)


def n_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
