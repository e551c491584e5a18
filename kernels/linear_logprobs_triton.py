"""GPU path of the fused LM-head log-prob/entropy op: cuBLAS GEMMs into a bounded fp32 workspace + Triton epilogues.

Forward (``forward_stats``), per ``[token chunk, vocab chunk]`` block of at most ``workspace_bytes``:
cuBLAS writes the block's logits ``h W_vᵀ`` with fp32 accumulation *and fp32 output* (never rounded to bf16),
then ``_stats_kernel`` folds each row of the block into softmax statistics (``vocab_stats``: max, Σexp,
Σexp·(z − max), target logit) with the temperature applied in fp32. Only the token chunk's ``[t, vocab chunks]``
partials leave the kernel; ``vocab_stats.combine`` merges them per token chunk. The full ``[T, V]`` logits
never exist.

Backward (``backward``), same blocking: cuBLAS recomputes the fp32 logits block, ``_dlogits_kernel`` turns it
into ``dz = (1/τ)·[g_lp·(onehot − p) − g_H·p·(z − Σp z)]`` in the input dtype, then cuBLAS does
``dh_chunk += dz W_v`` (fp32 accumulator, one cast per token chunk) and ``dW_v (+)= dzᵀ h_chunk``. No
atomics anywhere: dW is bitwise deterministic. When all selected rows fit one token chunk, each dW slice is
written exactly once.

Why cuBLAS + epilogue rather than one Triton GEMM-with-epilogue kernel: measured on an H100 (H=4096,
V=151936, T=16384), the fused Triton GEMM forward ran at 53.4 ms against 28.2 ms for the cuBLAS logits GEMM;
round-tripping the fp32 block through HBM costs 8 bytes per logit (~7 ms at this shape), far less than the gap.
That kernel loaded its tiles through masked pointer loads; ``REDLINE_LM_HEAD_GEMM=triton`` / ``triton-dz`` select
persistent TMA GEMMs with the statistics (forward) and dz (backward) epilogues inside (``lm_head_gemm_triton``):
measured beside this path, the forward's is still slower (39.6 against 36.3 ms), the backward's faster at long
batches (fwd+bwd 131.8 against 136.1 ms), so by default (``auto``) the backward takes it on Hopper from 16384
selected rows (``auto_fused_dz``).

On CPU tensors (Triton's interpreter, ``TRITON_INTERPRET=1``) the GEMMs run as fp32 ``torch.mm``.
"""

import torch
import triton
import triton.language as tl

from .backend import LM_HEAD_GEMM_AUTO, LM_HEAD_GEMM_KERNELS, lm_head_gemm, lm_head_gemm_module
from .lm_head_plan import backward_plan, forward_plan, round_up
from .vocab_stats import RowStats, combine

WORKSPACE_BYTES = 256 * 2**20
# fused_linear_policy_loss's default: room for 1472-token one-pass chunks at V=151936, where the one-pass path
# measured 113 ms against 141 ms for two passes in 256 MiB (H100, H=4096, T=16384; lm_head_plan)
POLICY_LOSS_WORKSPACE_BYTES = 2**30


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


ALIGN = 16 if _interpreting() else 256  # chunk sizes are multiples of this (GEMM-friendly on the GPU)
# stats kernel: rows × columns per step; dlogits kernel: elementwise tile (tiny under the interpreter)
STATS_LAUNCH = (dict(BLOCK_R=4, BLOCK_V=16, num_warps=1) if _interpreting()
                else dict(BLOCK_R=2, BLOCK_V=1024, num_warps=4))
TILE_R, TILE_V = (8, 16) if _interpreting() else (32, 256)


# The partials' column count and this block's column in them only index the per-row stores, which write one value
# per row: compiled as plain integers and pointers of any alignment, so a batch whose plan gives, say, 16 vocab pieces
# (Triton specializes multiples of 16) or whose row count times the pieces is odd (the partials of a [5, rows,
# pieces] buffer then start off 16-byte boundaries) meets no fresh compilation inside an RL step (issue 23).
@triton.jit(do_not_specialize=["n_pieces", "piece"],
            do_not_specialize_on_alignment=["m_ptr", "s_ptr", "w_ptr", "zy_ptr", "hit_ptr"])
def _stats_kernel(z_ptr, y_ptr, col0, m_ptr, s_ptr, w_ptr, zy_ptr, hit_ptr, n_rows, n_cols, stride_z, n_pieces,
                  piece, inv_temp, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Softmax statistics of BLOCK_R rows of an fp32 logits block ``[n_rows, n_cols]``.

    y holds each row's target id; the block's first column is id col0 (subtracted here rather than by a torch op
    per block on the host). Results go to column ``piece`` of
    the ``[R, n_pieces]`` partials, row ``r``.

    Each of the BLOCK_V lanes keeps its own running (max, Σexp, Σexp·(z − max)) and the lanes are merged
    once at the end: no cross-warp reduction inside the loop (five per step made the first version run at a
    third of HBM bandwidth), and one exp per logit — exp(−|z − m|) is either the new term or the rescale.
    """
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < n_rows
    m = tl.full((BLOCK_R, BLOCK_V), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)
    w = tl.zeros((BLOCK_R, BLOCK_V), tl.float32)
    for c0 in range(0, n_cols, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        z = tl.load(z_ptr + r[:, None] * stride_z + cols[None, :], mask=ok, other=float("-inf")) * inv_temp
        grows = z > m
        diff = z - m
        t = tl.exp(-tl.abs(diff))
        # new max: rescale the lane by t and add exp(0) = 1; otherwise add t·(z − m). An empty lane (s = 0,
        # m = -inf) and padding (z = -inf) would produce -inf·0 below, so they are kept out explicitly.
        w_up = tl.where(grows, tl.where(s > 0, t * (w - diff * s), 0.0), w + t * diff)
        s_up = tl.where(grows, s * t + 1.0, s + t)
        w = tl.where(ok, w_up, w)
        s = tl.where(ok, s_up, s)
        m = tl.where(grows, z, m)
    m_row = tl.max(m, axis=1)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    shift = m - m_safe[:, None]
    scale = tl.exp(shift)
    s_row = tl.sum(s * scale, axis=1)
    w_row = tl.sum(tl.where(s > 0, scale * (w + shift * s), 0.0), axis=1)

    target = tl.load(y_ptr + r, mask=row_ok, other=-1) - col0
    has_target = row_ok & (target >= 0) & (target < n_cols)
    zy = tl.load(z_ptr + r * stride_z + target, mask=has_target, other=0.0) * inv_temp
    out = r * n_pieces + piece
    tl.store(m_ptr + out, m_row, mask=row_ok)
    tl.store(s_ptr + out, s_row, mask=row_ok)
    tl.store(w_ptr + out, w_row, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)
    tl.store(hit_ptr + out, has_target.to(tl.float32), mask=row_ok)


@triton.jit
def dz_tile(z, cols, r, row_ok, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp,
            HAS_GENT: tl.constexpr):
    """``dz = (1/τ)·[g_lp·(onehot − p) − g_H·p·(z − Σp z)]`` (fp32) of a tile of temperature-scaled logits ``z``
    (rows ``r``, valid where ``row_ok``; columns ``cols``, column c being id ``c + col0`` of y's target ids), with
    the per-row lse, entropy, g_lp, g_H loaded here. Every Triton dz kernel (cuBLAS epilogue, fused GEMM, one-pass
    offsets, and the CuTe path's target column as a one-column tile) computes it through this one function."""
    lse = tl.load(lse_ptr + r, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + r, mask=row_ok, other=0.0)
    target = tl.load(y_ptr + r, mask=row_ok, other=-1) - col0  # masked rows: below 0, never a column
    p = tl.exp(z - lse[:, None])
    dz = g_lp[:, None] * ((cols[None, :] == target[:, None]).to(tl.float32) - p)
    if HAS_GENT:  # loaded after the first term: loaded before it, the 128×256 dz GEMM spilled 304 bytes, not 120
        sum_pz = lse - tl.load(ent_ptr + r, mask=row_ok, other=0.0)
        g_ent = tl.load(gent_ptr + r, mask=row_ok, other=0.0)
        dz -= g_ent[:, None] * p * (z - sum_pz[:, None])
    return dz * inv_temp


@triton.jit
def _dlogits_kernel(z_ptr, dz_ptr, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr, gent_ptr, n_rows, n_cols, inv_temp,
                    HAS_GENT: tl.constexpr, TILE_R: tl.constexpr, TILE_V: tl.constexpr):
    """dz (input dtype) of a contiguous fp32 logits block ``[n_rows, n_cols]`` whose first column is id col0 (y:
    target ids) and per-row values ``[n_rows]``."""
    r = tl.program_id(0).to(tl.int64) * TILE_R + tl.arange(0, TILE_R)
    cols = tl.program_id(1).to(tl.int64) * TILE_V + tl.arange(0, TILE_V)
    row_ok = r < n_rows
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    offs = r[:, None] * n_cols + cols[None, :]
    z = tl.load(z_ptr + offs, mask=ok, other=0.0) * inv_temp
    dz = dz_tile(z, cols, r, row_ok, y_ptr, col0, lse_ptr, ent_ptr, glp_ptr, gent_ptr, inv_temp, HAS_GENT)
    tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def _block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``[rows, cols]`` view at the start of a flat workspace (cuBLAS writes it with ld = cols)."""
    return buffer[: rows * cols].view(rows, cols)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out (+)= a @ b with fp32 accumulation; ``out`` may be fp32 while a, b are bf16/fp16 (cuBLAS out_dtype)."""
    if not out.is_cuda:  # the interpreter's CPU tensors
        prod = a.float() @ b.float()
        out.copy_(out.float() + prod if accumulate else prod)
    elif out.dtype != a.dtype:
        torch.addmm(out, a, b, beta=1.0 if accumulate else 0.0, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _rows_of(t: torch.Tensor, rows, t0: int, t1: int) -> torch.Tensor:
    return t[t0:t1] if rows is None else t.index_select(0, rows[t0:t1])


def forward_stats(hidden, weight, targets, rows, inv_temp: float, vocab_offset: int,
                  workspace_bytes: int = WORKSPACE_BYTES) -> RowStats:
    """Softmax statistics (``vocab_stats.RowStats``, ``[R]`` fp32) of the selected rows over ``weight``'s vocab.

    hidden ``[T, H]``, weight ``[V, H]`` (same dtype, contiguous), targets ``[T]`` int64 global ids, rows
    ``[R]`` int64 indices of the rows to compute or ``None`` for all rows. Extra memory, the ``[5, R]`` result
    included: ≤ workspace_bytes (``lm_head_plan.forward_plan``).
    """
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    vocab, width = weight.shape
    if n_rows == 0:
        return RowStats(*torch.zeros((5, 0), dtype=torch.float32, device=hidden.device))
    fused = fused_gemm(hidden, "stats", vocab=vocab)
    token_chunk, vocab_chunk = forward_plan(n_rows, vocab, width, rows is not None, hidden.element_size(),
                                            workspace_bytes, ALIGN, piece=fused.STATS_BLOCK_N if fused else None)
    pieces = triton.cdiv(vocab, fused.STATS_BLOCK_N if fused else vocab_chunk)
    stats = torch.empty((5, n_rows), dtype=torch.float32, device=hidden.device)
    parts = torch.empty((5, token_chunk, pieces), dtype=torch.float32, device=hidden.device)  # one chunk's
    logits = None if fused else torch.empty(token_chunk * vocab_chunk, dtype=torch.float32, device=hidden.device)
    for t0 in range(0, n_rows, token_chunk):
        tc = min(token_chunk, n_rows - t0)
        h, target = _rows_of(hidden, rows, t0, t0 + tc), _rows_of(targets, rows, t0, t0 + tc) - vocab_offset
        if fused:
            fused.gemm_stats(h, weight, target, parts[:, :tc], inv_temp)
        else:
            chunk_stats(h, weight, target, vocab_chunk, lambda v0, vc: _block(logits, tc, vc), parts, inv_temp)
        for merged, chunk in zip(stats, combine(RowStats(*parts[:, :tc]))):
            merged[t0:t0 + tc] = chunk
    return RowStats(*stats)


def chunk_stats(h, weight, target, vocab_chunk: int, block_of, parts, inv_temp: float) -> None:
    """Softmax statistics of one token chunk ``h [t, H]`` (``target [t]`` local ids) into the first t rows of
    ``parts [5, R, vocab chunks]``: per vocab chunk, cuBLAS writes the fp32 logits into ``block_of(v0, vc)`` (a
    contiguous ``[t, vc]`` view of the workspace) and ``_stats_kernel`` folds them."""
    tc, vocab = h.shape[0], weight.shape[0]
    for piece, v0 in enumerate(range(0, vocab, vocab_chunk)):
        vc = min(vocab_chunk, vocab - v0)
        block = block_of(v0, vc)
        _mm_into(block, h, weight[v0:v0 + vc].t())
        _stats_kernel[(triton.cdiv(tc, STATS_LAUNCH["BLOCK_R"]),)](
            block, target, v0, *parts, tc, vc, vc, parts.shape[2], piece, inv_temp, **STATS_LAUNCH)


def backward(hidden, weight, targets, rows, lse, entropy, grad_logp, grad_entropy, inv_temp: float,
             vocab_offset: int, workspace_bytes: int = WORKSPACE_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_hidden ``[T, H]`` hidden dtype, d_weight ``[V, H]`` weight dtype); unselected rows get zero gradient.

    lse, entropy, grad_logp, grad_entropy: ``[R]`` fp32 per selected row (grad_entropy may be None).
    Extra memory beyond the two gradients: at most ``workspace_bytes``. With ``REDLINE_LM_HEAD_GEMM=triton`` or
    ``triton-dz``, and by default where ``auto_fused_dz`` says so, the logits recompute and dz are one Triton
    kernel (``lm_head_gemm_triton``) and no fp32 block is kept.
    """
    n_rows = lse.numel()
    vocab, width = weight.shape
    gather = rows is not None
    if n_rows == 0:
        return torch.zeros_like(hidden), torch.zeros_like(weight)
    fused = fused_gemm(hidden, "dz", n_rows)
    d_weight = torch.empty_like(weight)
    d_hidden = torch.zeros_like(hidden) if gather else torch.empty_like(hidden)
    token_chunk, vocab_chunk = backward_plan(n_rows, vocab, width, gather, hidden.element_size(), workspace_bytes,
                                             ALIGN, keeps_logits=fused is None)
    logits = None if fused else torch.empty(token_chunk * vocab_chunk, dtype=torch.float32, device=hidden.device)
    stride_align = fused.STRIDE_ALIGN if fused else 1
    dz_buffer = torch.empty(token_chunk * round_up(vocab_chunk, stride_align), dtype=hidden.dtype,
                            device=hidden.device)
    dh = torch.empty((token_chunk, width), dtype=torch.float32, device=hidden.device)
    for t0 in range(0, n_rows, token_chunk):
        tc = min(token_chunk, n_rows - t0)
        h = _rows_of(hidden, rows, t0, t0 + tc)
        target = _rows_of(targets, rows, t0, t0 + tc) - vocab_offset
        row_values = tuple(None if x is None else x[t0:t0 + tc] for x in (lse, entropy, grad_logp, grad_entropy))

        def write_dz(v0: int, vc: int, dz: torch.Tensor) -> None:
            w_chunk = weight[v0:v0 + vc]
            if fused:
                fused.gemm_dz(h, w_chunk, dz, target, v0, row_values, inv_temp)
                return
            block = _block(logits, tc, vc)
            _mm_into(block, h, w_chunk.t())
            dz_from_logits(block, dz, target, v0, row_values, inv_temp)

        chunk_gradients(h, weight, vocab_chunk, write_dz, dz_buffer, stride_align, dh, d_weight, t0 > 0)
        store_rows(d_hidden, rows, t0, dh[:tc])
    return d_hidden, d_weight


# The default's backward: the Triton dz GEMM where it measured faster than cuBLAS + ``_dlogits_kernel`` (H100,
# H=4096, V=151936: fwd+bwd 131.8 vs 136.1 ms at 16384 rows, 268.3 vs 281.8 at 32768; 36.2 vs 34.1 at 4096)
AUTO_DZ_MIN_ROWS = 16384
AUTO_DZ_CAPABILITY = (9, 0)  # measured on Hopper only


def auto_fused_dz(capability: tuple[int, int] | None, n_rows: int, why_not: str | None) -> bool:
    """Whether ``REDLINE_LM_HEAD_GEMM=auto`` runs the backward's recompute + dz as the Triton GEMM: on the GPU it
    was measured on (``capability``; None for CPU tensors), for at least AUTO_DZ_MIN_ROWS selected rows, where the
    kernel can run (``why_not`` None, from ``lm_head_gemm_triton.supported``)."""
    return capability == AUTO_DZ_CAPABILITY and n_rows >= AUTO_DZ_MIN_ROWS and why_not is None


def auto_gemm(kernel: str, capability: tuple[int, int] | None, dtype: torch.dtype, width: int, vocab: int,
              n_rows: int, triton_why_not: str | None) -> str | None:
    """The ``LM_HEAD_GEMM_KERNELS`` choice ``auto`` runs ``kernel`` (``"stats"``, ``"dz"``) with, None for cuBLAS +
    epilogue: QuACK's CuTe GEMMs wherever they can run (``lm_head_gemm_cute.why_not``) on a GPU they were measured on
    (``lm_head_gemm_cute.MEASURED``), faster there than both other paths for both kernels (H100, H=4096,
    V=151936: fwd+bwd 122.8–124.0 against 128.1–137.6 ms at T=16384, 29.5 against 32.3–33.3 at T=4096;
    ``benchmarks/results/lm_head/lm-head-cute-h100/final``); else the Triton dz GEMM where ``auto_fused_dz`` says so
    (``triton_why_not``: ``lm_head_gemm_triton.supported``'s answer)."""
    from . import lm_head_gemm_cute

    if (capability in lm_head_gemm_cute.MEASURED
            and lm_head_gemm_cute.why_not(capability, dtype, width, vocab if kernel == "stats" else None) is None):
        return "cute"
    if kernel == "dz" and auto_fused_dz(capability, n_rows, triton_why_not):
        return "triton-dz"
    return None


def fused_gemm(hidden, kernel: str, n_rows: int = 0, vocab: int | None = None):
    """The module of fused GEMMs (``lm_head_gemm_triton`` or ``lm_head_gemm_cute``) when ``REDLINE_LM_HEAD_GEMM``
    selects its ``kernel`` (``"stats"`` over ``vocab`` columns, or ``"dz"``; ValueError naming the reason when a
    named choice cannot run on ``hidden``; ``auto`` decides by ``auto_gemm`` for the ``n_rows`` selected rows),
    else None (cuBLAS + ``_stats_kernel`` / ``_dlogits_kernel``)."""
    import importlib

    choice = lm_head_gemm()
    if choice == LM_HEAD_GEMM_AUTO:
        if not hidden.is_cuda:
            return None
        from . import lm_head_gemm_triton
        choice = auto_gemm(kernel, torch.cuda.get_device_capability(hidden.device), hidden.dtype, hidden.shape[1],
                           vocab, n_rows, lm_head_gemm_triton.supported(hidden))
        if choice is None:
            return None
        return importlib.import_module(f"redline.kernels.{lm_head_gemm_module(choice)}")
    if kernel not in LM_HEAD_GEMM_KERNELS[choice]:
        return None
    module = importlib.import_module(f"redline.kernels.{lm_head_gemm_module(choice)}")
    why_not = module.supported(hidden, vocab if kernel == "stats" else None)
    if why_not is not None:
        raise ValueError(f"REDLINE_LM_HEAD_GEMM={choice}: {why_not}; unset it to use cuBLAS")
    return module


def fused_piece(hidden, vocab: int) -> int | None:
    """Columns per statistics piece when a fused statistics GEMM runs over ``vocab`` columns (``lm_head_plan``'s
    ``piece``), else None."""
    fused = fused_gemm(hidden, "stats", vocab=vocab)
    return fused.STATS_BLOCK_N if fused else None


def dz_from_logits(block, dz, target, col0: int, row_values, inv_temp: float) -> None:
    """``_dlogits_kernel`` over a contiguous fp32 logits block ``[t, vc]`` into ``dz [t, vc]`` (contiguous)."""
    lse, entropy, grad_logp, grad_entropy = row_values
    tc, vc = block.shape
    grid = (triton.cdiv(tc, TILE_R), triton.cdiv(vc, TILE_V))
    _dlogits_kernel[grid](block, dz, target, col0, lse, entropy, grad_logp,
                          grad_entropy if grad_entropy is not None else grad_logp, tc, vc, inv_temp,
                          HAS_GENT=grad_entropy is not None, TILE_R=TILE_R, TILE_V=TILE_V, num_warps=4)


def chunk_gradients(h, weight, vocab_chunk: int, write_dz, dz_buffer, stride_align: int, dh, d_weight,
                    accumulate_dw: bool) -> None:
    """``dh[:t]`` (fp32) of one token chunk ``h [t, H]``, and its part of ``d_weight``.

    Per vocab chunk: ``write_dz(v0, vc, dz)`` fills the chunk's dz (input dtype, a ``[t, vc]`` view at the start
    of ``dz_buffer`` whose row stride is vc rounded up to ``stride_align``; 1: contiguous), then cuBLAS does
    ``dh += dz W_v`` and ``dW_v (+)= dzᵀ h`` (added to d_weight when ``accumulate_dw``).
    """
    tc, vocab = h.shape[0], weight.shape[0]
    for v0 in range(0, vocab, vocab_chunk):
        vc = min(vocab_chunk, vocab - v0)
        stride = round_up(vc, stride_align)
        dz = dz_buffer[: tc * stride].view(tc, stride)[:, :vc]
        write_dz(v0, vc, dz)
        _mm_into(dh[:tc], dz, weight[v0:v0 + vc], accumulate=v0 > 0)
        _mm_into(d_weight[v0:v0 + vc], dz.t(), h, accumulate=accumulate_dw)


def store_rows(d_hidden, rows, t0: int, dh) -> None:
    """Write ``dh [t, H]`` fp32 (selected rows t0…t0+t−1) into ``d_hidden`` in its dtype (rows None: all, in
    order)."""
    if rows is None:
        d_hidden[t0:t0 + dh.shape[0]].copy_(dh)
    else:
        d_hidden.index_copy_(0, rows[t0:t0 + dh.shape[0]], dh.to(d_hidden.dtype))
