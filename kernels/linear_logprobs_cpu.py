"""Chunked PyTorch execution of the fused LM-head log-prob/entropy op (the path used without a GPU).

Same contract as ``linear_logprobs_triton``: fp32 math on ``[token chunk, vocab chunk]`` logits blocks whose
size is bounded by ``workspace_bytes``, so the ``[T, V]`` logits never exist at once. Gradients accumulate in
fp32 and are cast once at the end. ``piece_stats`` and ``dlogits`` are the two epilogues (softmax statistics of
a logits block; dz of a logits block), shared with the one-pass policy-loss path (``linear_policy_loss_cpu``).
"""

import torch

from .vocab_stats import RowStats, merge

WORKSPACE_BYTES = 32 * 2**20  # fp32 logits block per step; small enough for a laptop, large enough for BLAS
POLICY_LOSS_WORKSPACE_BYTES = WORKSPACE_BYTES
ALIGN = 1  # chunk sizes need no rounding for BLAS (``lm_head_plan`` takes it)


def fused_piece(hidden, vocab: int) -> None:
    """The CPU path has no fused GEMMs (``lm_head_plan``'s ``piece``: None)."""
    return None


def _chunks(rows: int, vocab: int, workspace_bytes: int) -> tuple[int, int]:
    """(token chunk, vocab chunk) with token_chunk · vocab_chunk · 4 bytes ≤ workspace_bytes (at least 1 × 1)."""
    vocab_chunk = max(1, min(vocab, workspace_bytes // (4 * max(1, min(rows, 1024)))))
    token_chunk = max(1, min(rows, workspace_bytes // (4 * vocab_chunk)))
    return token_chunk, vocab_chunk


def rows_of(t: torch.Tensor, rows: torch.Tensor | None, t0: int, t1: int) -> torch.Tensor:
    """Rows ``t0:t1`` of the selection ``rows`` (``None``: all rows) of ``t``."""
    return t[t0:t1] if rows is None else t.index_select(0, rows[t0:t1])


def piece_stats(z: torch.Tensor, local_target: torch.Tensor, v0: int) -> RowStats:
    """``RowStats`` ``[R]`` of the temperature-scaled fp32 logits block ``z [R, n]`` holding ids ``v0 … v0+n−1``."""
    m = z.amax(dim=1)
    e = torch.exp(z - m[:, None])
    in_chunk = (local_target >= v0) & (local_target < v0 + z.shape[1])
    col = (local_target - v0).clamp(0, z.shape[1] - 1)
    zy = torch.where(in_chunk, z.gather(1, col[:, None])[:, 0], torch.zeros_like(m))
    return RowStats(m, e.sum(1), (e * (z - m[:, None])).sum(1), zy, in_chunk.float())


def dlogits(z: torch.Tensor, local_target: torch.Tensor, v0: int, lse, sum_pz, g_lp, g_ent,
            inv_temp: float) -> torch.Tensor:
    """``dz = (1/τ)·[g_lp·(onehot − p) − g_H·p·(z − Σp z)]`` of the scaled logits block ``z [R, n]`` (ids from v0).

    lse, sum_pz, g_lp, g_ent: ``[R]`` fp32 (g_ent may be None). Returns ``[R, n]`` fp32, the gradient w.r.t. the
    unscaled logits.
    """
    p = torch.exp(z - lse[:, None])
    cols = torch.arange(v0, v0 + z.shape[1], device=z.device)
    dz = g_lp[:, None] * ((cols[None, :] == local_target[:, None]).float() - p)
    if g_ent is not None:
        dz -= g_ent[:, None] * p * (z - sum_pz[:, None])
    return dz * inv_temp


def forward_stats(hidden, weight, targets, rows, inv_temp: float, vocab_offset: int,
                  workspace_bytes: int = WORKSPACE_BYTES) -> RowStats:
    """Softmax statistics of the rows ``rows`` (``None``: all rows) over this weight's vocabulary.

    hidden ``[T, H]``, weight ``[V, H]`` (global ids ``vocab_offset … vocab_offset + V − 1``), targets ``[T]``
    int64. Returns ``RowStats`` of ``[R]`` fp32 tensors, R = number of selected rows.
    """
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    vocab = weight.shape[0]
    token_chunk, vocab_chunk = _chunks(n_rows, vocab, workspace_bytes)
    out = [torch.empty(n_rows, dtype=torch.float32, device=hidden.device) for _ in range(5)]
    for t0 in range(0, n_rows, token_chunk):
        t1 = min(n_rows, t0 + token_chunk)
        h = rows_of(hidden, rows, t0, t1).float()
        local_target = rows_of(targets, rows, t0, t1) - vocab_offset
        acc = None
        for v0 in range(0, vocab, vocab_chunk):
            z = (h @ weight[v0:v0 + vocab_chunk].float().t()) * inv_temp
            piece = piece_stats(z, local_target, v0)
            acc = piece if acc is None else merge(acc, piece)
        for dst, src in zip(out, acc):
            dst[t0:t1] = src
    return RowStats(*out)


def backward(hidden, weight, targets, rows, lse, entropy, grad_logp, grad_entropy, inv_temp: float,
             vocab_offset: int, workspace_bytes: int = WORKSPACE_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_hidden ``[T, H]`` in hidden's dtype, d_weight ``[V, H]`` in weight's dtype).

    lse, entropy, grad_logp, grad_entropy are ``[R]`` fp32 for the selected rows (grad_entropy may be None).
    ``dz`` per logits block (``dlogits``), then ``dh = dz W``, ``dW = dzᵀ h``. Unselected rows get a zero
    gradient.
    """
    n_rows = lse.numel()
    vocab, width = weight.shape
    token_chunk, vocab_chunk = _chunks(n_rows, vocab, workspace_bytes)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    d_weight = torch.zeros((vocab, width), dtype=torch.float32, device=weight.device)
    sum_pz = lse - entropy
    for t0 in range(0, n_rows, token_chunk):
        t1 = min(n_rows, t0 + token_chunk)
        h = rows_of(hidden, rows, t0, t1).float()
        local_target = rows_of(targets, rows, t0, t1) - vocab_offset
        g_ent = None if grad_entropy is None else grad_entropy[t0:t1]
        dh = chunk_gradients(h, weight, vocab_chunk, d_weight, lambda v0, w: dlogits(
            (h @ w.t()) * inv_temp, local_target, v0, lse[t0:t1], sum_pz[t0:t1], grad_logp[t0:t1], g_ent, inv_temp))
        store_rows(d_hidden, rows, t0, t1, dh)
    return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype)


def chunk_gradients(h, weight, vocab_chunk: int, d_weight, dz_of) -> torch.Tensor:
    """``dh [t, H]`` fp32 of one token chunk ``h [t, H]`` fp32: per vocab chunk ``dz = dz_of(v0, w)`` (``w`` the
    chunk's fp32 weight rows), ``dh += dz w`` and, in place, ``d_weight[v0:…] += dzᵀ h``."""
    dh = torch.zeros((h.shape[0], weight.shape[1]), dtype=torch.float32, device=h.device)
    for v0 in range(0, weight.shape[0], vocab_chunk):
        w = weight[v0:v0 + vocab_chunk].float()
        dz = dz_of(v0, w)
        dh += dz @ w
        d_weight[v0:v0 + vocab_chunk] += dz.t() @ h
    return dh


def store_rows(d_hidden, rows, t0: int, t1: int, dh) -> None:
    """Write selected rows t0…t1−1's ``dh`` into ``d_hidden`` (rows None: all rows, in order)."""
    if rows is None:
        d_hidden[t0:t1] = dh
    else:
        d_hidden.index_copy_(0, rows[t0:t1], dh)
