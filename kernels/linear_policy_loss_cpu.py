"""Chunked PyTorch execution of the one-pass LM-head policy loss (the path used without a GPU).

The same pass as ``linear_policy_loss_triton.one_pass``: per token chunk (``lm_head_plan.token_chunk_bounds``),
the chunk's full-vocabulary fp32 logits (``[token chunk, V]``, within the workspace), their softmax statistics, the
caller's per-token gradients of the loss, then dz per vocab chunk from the kept logits and ``dh = dz W``,
``dW += dzᵀ h``. fp32 throughout, cast once at the end. The epilogues are ``linear_logprobs_cpu``'s.
"""

import itertools

import torch

from .linear_logprobs_cpu import chunk_gradients, dlogits, piece_stats, rows_of, store_rows
from .lm_head_plan import max_chunk
from .vocab_stats import all_reduce, finalize, merge


def one_pass(hidden, weight, targets, rows, inv_temp: float, vocab_offset: int, chunks, vocab_chunk: int,
             token_grads, group=None):
    """``(logp [R], entropy [R], d_hidden [T, H], d_weight [V, H])`` with the loss gradients of ``token_grads``.

    hidden ``[T, H]``, weight ``[V, H]`` (this rank's vocab shard with ``group``), targets ``[T]`` int64 global
    ids, rows ``[R]`` int64 selected rows or None (all). ``chunks``: the token chunks' boundaries ``[0, …, R]``
    among the selected rows (``lm_head_plan.token_chunk_bounds``), ``vocab_chunk`` the plan's
    (``lm_head_plan.one_pass_plan``). ``token_grads(t0, t1, logp, entropy)`` gets the ``[t1 − t0]`` fp32 logp
    and entropy of the chunk of selected rows t0…t1−1 and returns their ``(d loss/d logp, d loss/d entropy or
    None)``. d_hidden is this rank's part (the caller sums it over ``group``); unselected rows get zero gradient.
    """
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    vocab, width = weight.shape
    logp_out = torch.zeros(n_rows, dtype=torch.float32, device=hidden.device)
    entropy_out = torch.zeros_like(logp_out)
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    d_weight = torch.zeros((vocab, width), dtype=torch.float32, device=weight.device)
    z = torch.empty((max_chunk(chunks), vocab), dtype=torch.float32, device=hidden.device)
    for t0, t1 in itertools.pairwise(chunks):
        h = rows_of(hidden, rows, t0, t1).float()
        local_target = rows_of(targets, rows, t0, t1) - vocab_offset
        stats = None
        for v0 in range(0, vocab, vocab_chunk):  # the chunk's logits stay in z from the statistics to dz
            block = z[:t1 - t0, v0:v0 + vocab_chunk]
            torch.mm(h, weight[v0:v0 + vocab_chunk].float().t(), out=block)
            block *= inv_temp
            piece = piece_stats(block, local_target, v0)
            stats = piece if stats is None else merge(stats, piece)
        if group is not None:
            stats = all_reduce(stats, group)
        logp, entropy, lse = finalize(stats)
        logp_out[t0:t1], entropy_out[t0:t1] = logp, entropy
        g_lp, g_ent = token_grads(t0, t1, logp, entropy)
        dh = chunk_gradients(h, weight, vocab_chunk, d_weight, lambda v0, _w: dlogits(
            z[:t1 - t0, v0:v0 + vocab_chunk], local_target, v0, lse, lse - entropy, g_lp, g_ent, inv_temp))
        store_rows(d_hidden, rows, t0, t1, dh)
    return logp_out, entropy_out, d_hidden.to(hidden.dtype), d_weight.to(weight.dtype)
