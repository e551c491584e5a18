"""Per-row softmax statistics of temperature-scaled logits, computed piecewise over the vocabulary.

Every execution path (a Triton vocab split, a CPU vocab chunk, a tensor-parallel vocab shard) summarises
each row of ``z = W h / temperature`` over its piece of the vocabulary by five fp32 numbers:

    m   = max_v z_v                       (-inf for an empty piece)
    s   = Σ_v exp(z_v − m)
    w   = Σ_v exp(z_v − m) · (z_v − m)    (relative to the piece's own max: no large-number cancellation)
    zy  = z_target if the target id lies in the piece, else 0
    hit = 1 if the target id lies in the piece, else 0

Pieces merge exactly (``combine``; ``all_reduce`` for TP) and the merged row gives
``lse = m + log s``, ``entropy = log s − w / s`` and ``logp = min(zy − lse, 0)``.
"""

from typing import NamedTuple

import torch


class RowStats(NamedTuple):
    """Softmax statistics, each ``[R]`` (or ``[R, pieces]`` before ``combine``) fp32."""

    m: torch.Tensor
    s: torch.Tensor
    w: torch.Tensor
    zy: torch.Tensor
    hit: torch.Tensor


def _rebase(stats: RowStats, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, w) of ``stats`` re-expressed relative to ``new_max`` (broadcastable against stats.m)."""
    shift = stats.m - new_max
    scale = torch.exp(shift)  # exp(-inf) = 0 for empty pieces
    # An empty piece has s = 0 and m = -inf; guard the -inf·0 it would otherwise produce.
    shifted = torch.where(stats.s > 0, stats.w + shift * stats.s, torch.zeros_like(stats.w))
    return stats.s * scale, shifted * scale


def combine(stats: RowStats) -> RowStats:
    """Merge ``[R, pieces]`` statistics into ``[R]`` statistics over the union of the pieces."""
    m = stats.m.amax(dim=1)
    s, w = _rebase(stats, m[:, None])
    return RowStats(m, s.sum(1), w.sum(1), stats.zy.sum(1), stats.hit.sum(1))


def merge(a: RowStats, b: RowStats) -> RowStats:
    """Merge two ``[R]`` statistics over disjoint vocabulary pieces (online, used by chunked loops)."""
    m = torch.maximum(a.m, b.m)
    sa, wa = _rebase(a, m)
    sb, wb = _rebase(b, m)
    return RowStats(m, sa + sb, wa + wb, a.zy + b.zy, a.hit + b.hit)


def all_reduce(stats: RowStats, group) -> RowStats:
    """Merge ``[R]`` statistics across the vocab shards of a tensor-parallel ``group``.

    Two collectives: a MAX all-reduce of ``m``, then one packed SUM all-reduce of ``(s, w, zy, hit)``
    after every rank has re-expressed its sums relative to the global max.
    """
    import torch.distributed as dist

    m = stats.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s, w = _rebase(stats, m)
    packed = torch.stack([s, w, stats.zy, stats.hit])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return RowStats(m, packed[0], packed[1], packed[2], packed[3])


def finalize(stats: RowStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` ``[R]`` fp32 from full-vocabulary statistics.

    ``logp`` is clamped to ≤ 0 (rounding can only push it above; a log-probability cannot be). A row whose
    target id lies outside the vocabulary (no piece hit it) gets ``logp = NaN`` rather than a plausible number.
    """
    log_s = torch.log(stats.s)
    lse = stats.m + log_s
    entropy = (log_s - stats.w / stats.s).clamp_min(0.0)
    logp = torch.clamp(stats.zy - lse, max=0.0)
    logp = torch.where(stats.hit > 0, logp, torch.full_like(logp, float("nan")))
    return logp, entropy, lse
