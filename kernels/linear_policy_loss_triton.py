"""GPU path of the one-pass LM-head policy loss: 6·T·H·V FLOPs, the logits computed once.

Per token chunk of at most ``token chunk`` selected rows (``lm_head_plan.one_pass_plan``):
  1. cuBLAS writes the chunk's full-vocabulary logits ``h Wᵀ`` in fp32 into the workspace, one vocab chunk at a
     time (each vocab chunk a contiguous ``[rows, vocab chunk]`` block), and ``_stats_kernel`` folds each block
     into softmax statistics; ``combine`` (and with tensor parallelism an all-reduce of the statistics) gives the
     chunk's lse, logp, entropy;
  2. the caller's ``token_grads`` turns them into d loss/d logp and d loss/d entropy of those tokens — possible
     now because a token-level estimator's gradient depends on the token alone (and on aggregation weights
     known up front);
  3. per vocab chunk, ``_dlogits_kernel`` reads the kept fp32 logits and writes dz in the input dtype, then
     cuBLAS does ``dh += dz W_v`` (fp32 accumulator) and ``dW_v (+)= dzᵀ h``.
No atomics: dW is bitwise deterministic. dW is read-modify-written once per token chunk (``V·H·2·itemsize``
bytes), which is why the path needs a workspace holding many tokens' logits (``lm_head_plan``).
"""

import torch
import triton

from .linear_logprobs_triton import STATS_LAUNCH, TILE_R, TILE_V, _block, _dlogits_kernel, _mm_into, _rows_of
from .linear_logprobs_triton import _stats_kernel
from .vocab_stats import RowStats, all_reduce, combine, finalize


def one_pass(hidden, weight, targets, rows, inv_temp: float, vocab_offset: int, plan, token_grads, group=None):
    """``(logp [R], entropy [R], d_hidden [T, H], d_weight [V, H])`` with the loss gradients of ``token_grads``.

    hidden ``[T, H]``, weight ``[V, H]`` (same dtype, contiguous; this rank's vocab shard with ``group``),
    targets ``[T]`` int64 global ids, rows ``[R]`` int64 selected rows or None (all). ``plan``:
    ``(token chunk, vocab chunk)``. ``token_grads(t0, t1, logp, entropy)`` gets the ``[t1 − t0]`` fp32 logp and
    entropy of selected rows t0…t1−1 and returns their ``(d loss/d logp, d loss/d entropy or None)``, ``[t1 − t0]``
    contiguous fp32. d_hidden is this rank's part (the caller sums it over ``group``); unselected rows get zero.
    Workspace: ``token chunk·(4·V + itemsize·vocab chunk + 4·H [+ itemsize·H with rows])`` bytes.
    """
    token_chunk, vocab_chunk = plan
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    vocab, width = weight.shape
    device = hidden.device
    logp_out = torch.zeros(n_rows, dtype=torch.float32, device=device)
    entropy_out = torch.zeros_like(logp_out)
    d_weight = torch.zeros_like(weight) if n_rows == 0 else torch.empty_like(weight)
    d_hidden = torch.zeros_like(hidden) if rows is not None or n_rows == 0 else torch.empty_like(hidden)
    if n_rows == 0:
        return logp_out, entropy_out, d_hidden, d_weight
    token_chunk = min(token_chunk, n_rows)
    pieces = triton.cdiv(vocab, vocab_chunk)
    logits = torch.empty(token_chunk * vocab, dtype=torch.float32, device=device)
    dz_buffer = torch.empty(token_chunk * vocab_chunk, dtype=hidden.dtype, device=device)
    dh = torch.empty((token_chunk, width), dtype=torch.float32, device=device)
    parts = torch.empty((5, token_chunk, pieces), dtype=torch.float32, device=device)
    for t0 in range(0, n_rows, token_chunk):
        tc = min(token_chunk, n_rows - t0)
        h = _rows_of(hidden, rows, t0, t0 + tc)
        target = _rows_of(targets, rows, t0, t0 + tc) - vocab_offset

        def logits_block(v0: int, vc: int) -> torch.Tensor:
            return logits[tc * v0: tc * (v0 + vc)].view(tc, vc)

        for piece, v0 in enumerate(range(0, vocab, vocab_chunk)):
            vc = min(vocab_chunk, vocab - v0)
            block = logits_block(v0, vc)
            _mm_into(block, h, weight[v0:v0 + vc].t())
            _stats_kernel[(triton.cdiv(tc, STATS_LAUNCH["BLOCK_R"]),)](
                block, target - v0, *parts, tc, vc, vc, 0, pieces, piece, inv_temp, **STATS_LAUNCH)
        stats = combine(RowStats(*parts[:, :tc]))
        if group is not None:
            stats = all_reduce(stats, group)
        logp, entropy, lse = finalize(stats)
        logp_out[t0:t0 + tc], entropy_out[t0:t0 + tc] = logp, entropy
        g_lp, g_ent = token_grads(t0, t0 + tc, logp, entropy)
        for v0 in range(0, vocab, vocab_chunk):
            vc = min(vocab_chunk, vocab - v0)
            block, dz = logits_block(v0, vc), _block(dz_buffer, tc, vc)
            grid = (triton.cdiv(tc, TILE_R), triton.cdiv(vc, TILE_V))
            _dlogits_kernel[grid](block, dz, target - v0, lse, entropy, g_lp, g_lp if g_ent is None else g_ent, tc,
                                  vc, 0, inv_temp, HAS_GENT=g_ent is not None, TILE_R=TILE_R, TILE_V=TILE_V,
                                  num_warps=4)
            _mm_into(dh[:tc], dz, weight[v0:v0 + vc], accumulate=v0 > 0)
            _mm_into(d_weight[v0:v0 + vc], dz.t(), h, accumulate=t0 > 0)
        if rows is not None:
            d_hidden.index_copy_(0, rows[t0:t0 + tc], dh[:tc].to(hidden.dtype))
        else:
            d_hidden[t0:t0 + tc].copy_(dh[:tc])
    return logp_out, entropy_out, d_hidden, d_weight
