"""Triton kernels of the fused LM-head log-prob/entropy op (GPU path; CPU tensors under TRITON_INTERPRET=1).

Forward (``forward_stats``): one program per (BLOCK_M selected rows, vocab split). It runs the logits GEMM
tile by tile with an fp32 ``tl.dot`` accumulator, scales by 1/τ and folds every ``[BLOCK_M, BLOCK_N]`` tile
into running per-row statistics (``vocab_stats``: max, Σexp, Σexp·(z − max), target logit) held in
registers. Logits never reach HBM; only ``[R, splits]`` partials do, merged by ``vocab_stats.combine``.

Backward (``backward``): token chunks × vocab chunks. A Triton kernel recomputes each logits tile and writes
``dz = (1/τ)·[g_lp·(onehot − p) − g_H·p·(z − Σp z)]`` in the input dtype into a workspace whose size is
bounded by ``workspace_bytes`` (independent of T); cuBLAS then does ``dh_chunk += dz W_v`` (fp32 accumulator,
one cast per token chunk) and ``dW_v (+)= dzᵀ h_chunk``. No atomics: dW is bitwise deterministic. When all
selected rows fit one token chunk, every dW slice is written exactly once.
"""

import torch
import triton
import triton.language as tl

from .vocab_stats import RowStats, combine

WORKSPACE_BYTES = 256 * 2**20


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs ask for an exact product; Triton's default for fp32 dots is tf32 (≈1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, stride_h, stride_w,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_N]`` tile of h[rows] · W[cols]ᵀ (rows, cols int64)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    h_base = h_ptr + rows[:, None] * stride_h
    w_base = w_ptr + cols[None, :] * stride_w
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < H
        a = tl.load(h_base + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 incorrectly; fp32 products of bf16 values are exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """(m, n) of program ``pid`` in GROUP_M-row bands, m fastest: the programs in flight share a few row tiles
    of hidden and a few column tiles of W, which then stay in L2 (an m-fastest 2-D grid would stream all of
    hidden through L2 once per vocab tile)."""
    per_band = GROUP_M * n_n
    band = pid // per_band
    first_m = band * GROUP_M
    rows_in_band = tl.minimum(n_m - first_m, GROUP_M)
    local = pid % per_band
    return first_m + local % rows_in_band, local // rows_in_band


@triton.jit
def _stats_kernel(h_ptr, w_ptr, y_ptr, rows_ptr, m_ptr, s_ptr, w_out_ptr, zy_ptr, hit_ptr,
                  R, V, H, stride_h, stride_w, vocab_offset, inv_temp, n_splits,
                  HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, split = _grouped(tl.program_id(0), tl.cdiv(R, BLOCK_M), n_splits, GROUP_M)
    offs_r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < R
    if HAS_ROWS:
        rows = tl.load(rows_ptr + offs_r, mask=row_ok, other=0).to(tl.int64)
    else:
        rows = offs_r
    target = tl.load(y_ptr + rows, mask=row_ok, other=-1) - vocab_offset

    n_tiles = tl.cdiv(V, BLOCK_N)
    per_split = tl.cdiv(n_tiles, n_splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    w = tl.zeros((BLOCK_M,), tl.float32)
    zy = tl.zeros((BLOCK_M,), tl.float32)
    hit = tl.zeros((BLOCK_M,), tl.float32)
    for tile in range(tile_lo, tile_hi):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)  # tile * BLOCK_N ≤ V fits int32
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, stride_h, stride_w,
                         BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION) * inv_temp
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = m - m_new
        scale = tl.exp(shift)
        e = tl.exp(z - m_new[:, None])  # 0 at padding columns (z = -inf)
        d = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        # the first tile meets m = -inf, s = 0: keep the rebase term at 0 instead of -inf·0
        w = scale * (w + tl.where(s > 0, shift, 0.0) * s) + tl.sum(e * d, axis=1)
        s = s * scale + tl.sum(e, axis=1)
        m = m_new
        is_target = (cols[None, :] == target[:, None]) & col_ok[None, :]
        zy += tl.sum(tl.where(is_target, z, 0.0), axis=1)
        hit += tl.sum(is_target.to(tl.float32), axis=1)

    out = offs_r * n_splits + split
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(w_out_ptr + out, w, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)
    tl.store(hit_ptr + out, hit, mask=row_ok)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, y_ptr, rows_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dz_ptr,
                    row_start, n_rows, col_start, n_cols, H, stride_h, stride_w, stride_dz, vocab_offset, inv_temp,
                    HAS_ROWS: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    local_r = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    local_c = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = local_r < n_rows
    col_ok = local_c < n_cols
    sel = row_start + local_r  # index into the selected rows (and into lse, grads)
    if HAS_ROWS:
        rows = tl.load(rows_ptr + sel, mask=row_ok, other=0).to(tl.int64)
    else:
        rows = sel
    cols = col_start + local_c
    z = _logits_tile(h_ptr, w_ptr, rows, row_ok, cols, col_ok, H, stride_h, stride_w,
                     BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION) * inv_temp
    lse = tl.load(lse_ptr + sel, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + sel, mask=row_ok, other=0.0)
    target = tl.load(y_ptr + rows, mask=row_ok, other=-1) - vocab_offset
    p = tl.exp(z - lse[:, None])
    onehot = (cols[None, :] == target[:, None]).to(tl.float32)
    dz = g_lp[:, None] * (onehot - p)
    if HAS_GENT:
        sum_pz = lse - tl.load(ent_ptr + sel, mask=row_ok, other=0.0)
        g_ent = tl.load(gent_ptr + sel, mask=row_ok, other=0.0)
        dz -= g_ent[:, None] * p * (z - sum_pz[:, None])
    dz *= inv_temp
    tl.store(dz_ptr + local_r[:, None] * stride_dz + local_c[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _configs(dtype_is_fp32: bool) -> list:
    """Launch configurations tried by the autotuner on the GPU (the interpreter runs one tiny tile)."""
    if _interpreting():
        return [triton.Config(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2))]
    if dtype_is_fp32:
        return [triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8), num_warps=4, num_stages=2)]
    shapes = [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4),
              (256, 128, 64, 8, 3)]
    return [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=16), num_warps=w, num_stages=st)
            for m, n, k, w, st in shapes]


def _tuned(kernel, fp32: bool):
    configs = _configs(fp32)
    if len(configs) == 1:
        return kernel, configs[0]
    return triton.autotune(configs, key=["H"])(kernel), None


_STATS = {fp32: _tuned(_stats_kernel, fp32) for fp32 in (False, True)}
_DLOGITS = {fp32: _tuned(_dlogits_kernel, fp32) for fp32 in (False, True)}
ALIGN = 16 if _interpreting() else 256  # chunk sizes are multiples of every tile size above


def _launch(table, dtype, grid_of, *args, **kwargs):
    kernel, config = table[dtype == torch.float32]
    if config is None:
        kernel[lambda meta: grid_of(meta)](*args, **kwargs)
    else:
        kernel[grid_of(config.kwargs)](*args, **kwargs, **config.kwargs, num_warps=config.num_warps,
                                       num_stages=config.num_stages)


def _num_splits(n_rows: int, vocab: int, device: torch.device) -> int:
    """Vocab splits per row tile: ~4096 columns each, more when few rows would leave SMs idle."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    row_tiles = triton.cdiv(max(n_rows, 1), 128)
    return max(1, min(triton.cdiv(vocab, 128), max(triton.cdiv(8 * sms, row_tiles), triton.cdiv(vocab, 4096))))


def forward_stats(hidden, weight, targets, rows, inv_temp: float, vocab_offset: int) -> RowStats:
    """Softmax statistics (``vocab_stats.RowStats``, ``[R]`` fp32) of the selected rows over ``weight``'s vocab.

    hidden ``[T, H]``, weight ``[V, H]`` (same dtype, row-major in H), targets ``[T]`` int64 global ids,
    rows ``[R]`` int64 indices of the rows to compute or ``None`` for all rows.
    """
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    vocab, width = weight.shape
    splits = _num_splits(n_rows, vocab, hidden.device)
    parts = torch.empty((5, n_rows, splits), dtype=torch.float32, device=hidden.device)
    if n_rows == 0:
        return RowStats(*(p[:, 0] for p in parts))
    _launch(_STATS, hidden.dtype, lambda meta: (triton.cdiv(n_rows, meta["BLOCK_M"]) * splits,),
            hidden, weight, targets, rows if rows is not None else targets, *parts,
            n_rows, vocab, width, hidden.stride(0), weight.stride(0), vocab_offset, inv_temp, splits,
            HAS_ROWS=rows is not None, UPCAST=_interpreting(), PRECISION=_dot_precision(hidden.dtype))
    return combine(RowStats(*parts))


def _chunk_plan(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int,
                align: int) -> tuple[int, int]:
    """(token chunk, vocab chunk), multiples of ``align`` (the tile size), whose buffers fit ``budget`` bytes.

    Per token of a chunk: an fp32 dh accumulator (4·H) and, with a row mask, the gathered hidden row
    (itemsize·H); half the budget at most. The dz workspace ``[token chunk, vocab chunk]`` gets the rest.
    """
    per_token = width * (4 + (itemsize if gather else 0))
    token_chunk = min(_round_up(n_rows, align), max(align, (budget // 2) // per_token // align * align))
    vocab_chunk = (budget - token_chunk * per_token) // (token_chunk * itemsize) // align * align
    return min(token_chunk, n_rows), min(vocab, max(align, vocab_chunk))


def _round_up(x: int, k: int) -> int:
    return triton.cdiv(x, k) * k


def _mm_into(out, a, b, accumulate: bool):
    """out (+)= a @ b with fp32 accumulation (cuBLAS on CUDA; fp32 upcast on the interpreter's CPU tensors)."""
    if out.device.type != "cuda":
        prod = a.float() @ b.float()
        out.copy_(out.float() + prod if accumulate else prod)
    elif out.dtype == torch.float32 and a.dtype != torch.float32:
        torch.addmm(out, a, b, beta=1.0 if accumulate else 0.0, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def backward(hidden, weight, targets, rows, lse, entropy, grad_logp, grad_entropy, inv_temp: float,
             vocab_offset: int, workspace_bytes: int = WORKSPACE_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_hidden ``[T, H]`` hidden dtype, d_weight ``[V, H]`` weight dtype); unselected rows get zero gradient.

    lse, entropy, grad_logp, grad_entropy: ``[R]`` fp32 per selected row (grad_entropy may be None).
    Extra memory: at most ``workspace_bytes`` (dz workspace + fp32 dh accumulator + gathered rows).
    """
    n_rows = lse.numel()
    vocab, width = weight.shape
    gather = rows is not None
    d_weight = torch.zeros_like(weight) if n_rows == 0 else torch.empty_like(weight)
    d_hidden = torch.zeros_like(hidden) if gather or n_rows == 0 else torch.empty_like(hidden)
    if n_rows == 0:
        return d_hidden, d_weight
    token_chunk, vocab_chunk = _chunk_plan(n_rows, vocab, width, gather, hidden.element_size(), workspace_bytes,
                                           ALIGN)
    dz = torch.empty((token_chunk, vocab_chunk), dtype=hidden.dtype, device=hidden.device)
    dh = torch.empty((token_chunk, width), dtype=torch.float32, device=hidden.device)
    for t0 in range(0, n_rows, token_chunk):
        tc = min(token_chunk, n_rows - t0)
        h = hidden.index_select(0, rows[t0:t0 + tc]) if gather else hidden[t0:t0 + tc]
        for v0 in range(0, vocab, vocab_chunk):
            vc = min(vocab_chunk, vocab - v0)
            _launch(_DLOGITS, hidden.dtype,
                    lambda meta: (triton.cdiv(tc, meta["BLOCK_M"]) * triton.cdiv(vc, meta["BLOCK_N"]),),
                    hidden, weight, targets, rows if gather else targets, lse, entropy, grad_logp,
                    grad_entropy if grad_entropy is not None else grad_logp, dz,
                    t0, tc, v0, vc, width, hidden.stride(0), weight.stride(0), dz.stride(0),
                    vocab_offset, inv_temp, HAS_ROWS=gather, HAS_GENT=grad_entropy is not None,
                    UPCAST=_interpreting(), PRECISION=_dot_precision(hidden.dtype))
            block = dz[:tc, :vc]
            _mm_into(dh[:tc], block, weight[v0:v0 + vc], accumulate=v0 > 0)
            _mm_into(d_weight[v0:v0 + vc], block.t(), h, accumulate=t0 > 0)
        if gather:
            d_hidden.index_copy_(0, rows[t0:t0 + tc], dh[:tc].to(hidden.dtype))
        else:
            d_hidden[t0:t0 + tc].copy_(dh[:tc])
    return d_hidden, d_weight
