"""GPU path of the one-pass LM-head policy loss: 6·T·H·V FLOPs, the logits computed once.

Per token chunk of at most ``token chunk`` selected rows (``lm_head_plan.one_pass_plan``; the chunks' boundaries
from ``lm_head_plan.token_chunk_bounds``, whole sequences per chunk for gspo):
  1. cuBLAS writes the chunk's full-vocabulary logits ``h Wᵀ`` in fp32 into the workspace, one vocab chunk at a
     time (each vocab chunk a contiguous ``[rows, vocab chunk]`` block), and ``_stats_kernel`` folds each block
     into softmax statistics; ``combine`` (and with tensor parallelism an all-reduce of the statistics) gives the
     chunk's lse, logp, entropy;
  2. the caller's ``token_grads`` turns them into d loss/d logp and d loss/d entropy of those tokens — possible
     now because a token-level estimator's gradient depends on the token alone, gspo's on the token's sequence,
     all of it in the chunk (and both on aggregation weights known up front);
  3. per vocab chunk, ``_dlogits_kernel`` reads the kept fp32 logits and writes dz in the input dtype, then
     cuBLAS does ``dh += dz W_v`` (fp32 accumulator) and ``dW_v (+)= dzᵀ h``.
No atomics: dW is bitwise deterministic. dW is read-modify-written once per token chunk (``V·H·2·itemsize``
bytes), which is why the path needs a workspace holding many tokens' logits (``lm_head_plan``).

With ``REDLINE_LM_HEAD_GEMM=triton`` step 1 is one Triton GEMM (``lm_head_gemm_triton.gemm_stats``) that writes
the statistics per 128-column piece and keeps each logit as an offset from its piece's max — fp16 for bf16/fp16
inputs (2 bytes instead of 4: twice the tokens per chunk in the same workspace, half the dW read-modify-writes),
fp32 for fp32 inputs — and step 3 rebuilds the logits from them (``dz_from_offsets``); the statistics, hence logp,
entropy and the loss, stay exact fp32, and with fp16 offsets dz carries their rounding (≤ 2⁻¹¹ of the offset) on
top of its own.
"""

import itertools

import torch
import triton

from .linear_logprobs_triton import _rows_of, chunk_gradients, chunk_stats, dz_from_logits, fused_gemm, store_rows
from .lm_head_plan import max_chunk, round_up
from .vocab_stats import RowStats, all_reduce, combine, finalize


def one_pass(hidden, weight, targets, rows, inv_temp: float, vocab_offset: int, chunks, vocab_chunk: int,
             token_grads, group=None):
    """``(logp [R], entropy [R], d_hidden [T, H], d_weight [V, H])`` with the loss gradients of ``token_grads``.

    hidden ``[T, H]``, weight ``[V, H]`` (same dtype, contiguous; this rank's vocab shard with ``group``),
    targets ``[T]`` int64 global ids, rows ``[R]`` int64 selected rows or None (all). ``chunks``: the token
    chunks' boundaries ``[0, …, R]`` among the selected rows (``lm_head_plan.token_chunk_bounds``),
    ``vocab_chunk`` the plan's. ``token_grads(t0, t1, logp, entropy)`` gets the ``[t1 − t0]`` fp32 logp and
    entropy of the chunk of selected rows t0…t1−1 and returns their ``(d loss/d logp, d loss/d entropy or
    None)``, ``[t1 − t0]`` contiguous fp32. d_hidden is this rank's part (the caller sums it over ``group``);
    unselected rows get zero. Workspace, with token chunk = the longest chunk:
    ``token chunk·(kept + itemsize·vocab chunk + 4·H [+ itemsize·H with rows])`` bytes, kept = 4·V
    (fp32 logits) or, fused, 2·V plus the statistics pieces (``lm_head_plan._kept_bytes_per_token``).
    """
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    vocab, width = weight.shape
    device = hidden.device
    logp_out = torch.zeros(n_rows, dtype=torch.float32, device=device)
    entropy_out = torch.zeros_like(logp_out)
    d_weight = torch.zeros_like(weight) if n_rows == 0 else torch.empty_like(weight)
    d_hidden = torch.zeros_like(hidden) if rows is not None or n_rows == 0 else torch.empty_like(hidden)
    if n_rows == 0:
        return logp_out, entropy_out, d_hidden, d_weight
    token_chunk = max_chunk(chunks)
    fused = fused_gemm(hidden, "stats", vocab=vocab)  # the kept offsets come with the statistics GEMM
    pieces = triton.cdiv(vocab, fused.STATS_BLOCK_N if fused else vocab_chunk)
    if fused:  # each logit kept as an offset from its statistics piece's max (rows padded for TMA)
        row_stride = round_up(vocab, fused.STRIDE_ALIGN)
        kept = torch.empty(token_chunk * row_stride, dtype=fused.offset_dtype(hidden.dtype), device=device)
    else:
        kept = torch.empty(token_chunk * vocab, dtype=torch.float32, device=device)
    dz_buffer = torch.empty(token_chunk * vocab_chunk, dtype=hidden.dtype, device=device)
    dh = torch.empty((token_chunk, width), dtype=torch.float32, device=device)
    parts = torch.empty((5, token_chunk, pieces), dtype=torch.float32, device=device)
    for t0, t1 in itertools.pairwise(chunks):
        tc = t1 - t0
        h = _rows_of(hidden, rows, t0, t1)
        target = _rows_of(targets, rows, t0, t1) - vocab_offset

        def logits_block(v0: int, vc: int) -> torch.Tensor:
            return kept[tc * v0: tc * (v0 + vc)].view(tc, vc)

        if fused:
            offsets = kept[:tc * row_stride].view(tc, row_stride)[:, :vocab]
            fused.gemm_stats(h, weight, target, parts[:, :tc], inv_temp, offsets=offsets)
        else:
            chunk_stats(h, weight, target, vocab_chunk, logits_block, parts, inv_temp)
        stats = combine(RowStats(*parts[:, :tc]))
        if group is not None:
            stats = all_reduce(stats, group)
        logp, entropy, lse = finalize(stats)
        logp_out[t0:t1], entropy_out[t0:t1] = logp, entropy
        g_lp, g_ent = token_grads(t0, t1, logp, entropy)
        row_values = (lse, entropy, g_lp, g_ent)

        def write_dz(v0: int, vc: int, dz: torch.Tensor) -> None:
            if fused:
                fused.dz_from_offsets(offsets, parts[0, :tc], dz, target, v0, row_values, inv_temp)
            else:
                dz_from_logits(logits_block(v0, vc), dz, target, v0, row_values, inv_temp)

        chunk_gradients(h, weight, vocab_chunk, write_dz, dz_buffer, 1, dh, d_weight, t0 > 0)
        store_rows(d_hidden, rows, t0, dh[:tc])
    return logp_out, entropy_out, d_hidden, d_weight
