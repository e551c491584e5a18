"""Triton kernels of the policy loss: the loss, its metrics and its per-token gradients in two launches.

The math is ``redline.kernels.reference.policy_loss_reference``. No host sync; one memset of a small counter
buffer besides the two launches. The grid is ``(S, SPLIT)``: program (i, j) handles blocks j, j+SPLIT, ... of
sequence i, so long sequences are spread over SPLIT programs and short ones get one each.
  pass 1  per-program partials of sequence i (masked-token count; gspo: Σ log-ratio and Σ w·A split by the
          sign of A) and two integer atomics: the batch's masked-token count and its count of sequences with
          at least one masked token.
  pass 2  sums the partials of its sequence in a fixed order, computes per-token loss and gradients, writes
          its partial sums of loss and metrics, and the last program to finish (an atomic ticket) reduces them
          in program order. Every float sum has a fixed order, so results are bitwise reproducible.
gspo's ratio is per sequence, and whether a token's loss still depends on it (not clipped) is decided by the
sign of its advantage alone, so Σ_t w_t·∂pg_t/∂r — the sum the gradient needs — comes from pass 1's two
signed sums; no third pass. Config scalars are ``tl.constexpr`` (one compile per config; never fp64 arguments).

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the tests do that).
"""

import torch
import triton
import triton.language as tl

from redline.kernels.loss_config import LossConfig
from redline.kernels.reference import METRIC_NAMES

ESTIMATOR_IDS = {"ppo": 0, "gspo": 1, "cispo": 2}
KL_TYPE_IDS = {"k1": 0, "k2": 1, "k3": 2, "low_var_kl": 3}
TIS_IDS = {None: 0, "truncate": 1, "icepop": 2}
AGG_IDS = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
SEQ_STATS = 4  # pass-1 partials per program: count, Σ log-ratio, Σ w·A (A > 0), Σ w·A (A < 0)
PROGRAM_SUMS = 8  # pass-2 partials per program: loss, then the metrics in METRIC_NAMES order
MAX_SPLIT = 256
MAX_TOKENS = 2**31 - 1  # token offsets are int32


@triton.jit
def _sequence_span(cu_seqlens_ptr, seq, num_tokens, HAS_CU: tl.constexpr):
    if HAS_CU:
        start = tl.load(cu_seqlens_ptr + seq)
        end = tl.load(cu_seqlens_ptr + seq + 1)
    else:
        start = seq * 0
        end = seq * 0 + num_tokens
    return start, end


@triton.jit
def _tis_weight(old, rollout, TIS: tl.constexpr, TIS_LOW: tl.constexpr, TIS_HIGH: tl.constexpr):
    """(applied weight, outside the bounds) of w = exp(old - rollout)."""
    w = tl.exp(old - rollout)
    outside = (w < TIS_LOW) | (w > TIS_HIGH)
    if TIS == 1:
        applied = tl.minimum(tl.maximum(w, TIS_LOW), TIS_HIGH)
    else:
        applied = tl.where(outside, 0.0, w)
    return applied, outside


@triton.jit
def _sequence_stats_kernel(logp_ptr, old_ptr, adv_ptr, mask_ptr, rollout_ptr, cu_seqlens_ptr, seq_stats_ptr,
                           counters_ptr, num_tokens, HAS_CU: tl.constexpr, GSPO: tl.constexpr,
                           TIS: tl.constexpr, TIS_LOW: tl.constexpr, TIS_HIGH: tl.constexpr,
                           SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    seq = tl.program_id(0)
    part = tl.program_id(1)
    start, end = _sequence_span(cu_seqlens_ptr, seq, num_tokens, HAS_CU)
    count = tl.zeros([BLOCK], tl.int32)
    log_ratio = tl.zeros([BLOCK], tl.float32)
    adv_pos = tl.zeros([BLOCK], tl.float32)
    adv_neg = tl.zeros([BLOCK], tl.float32)
    for block_start in range(start + part * BLOCK, end, SPLIT * BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        m = (offs < end) & (tl.load(mask_ptr + offs, mask=offs < end, other=0) != 0)
        count += m.to(tl.int32)
        if GSPO:
            logp = tl.load(logp_ptr + offs, mask=m, other=0.0)
            old = tl.load(old_ptr + offs, mask=m, other=0.0)
            adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
            log_ratio += logp - old
            if TIS != 0:
                w, _ = _tis_weight(old, tl.load(rollout_ptr + offs, mask=m, other=0.0), TIS, TIS_LOW, TIS_HIGH)
                adv = adv * w
            adv_pos += tl.where(adv > 0, adv, 0.0)
            adv_neg += tl.where(adv < 0, adv, 0.0)
    n = tl.sum(count, 0)
    row = seq_stats_ptr + (seq * SPLIT + part) * 4
    tl.store(row, n.to(tl.float32))
    if GSPO:  # the other columns are read by gspo only
        tl.store(row + 1, tl.sum(log_ratio, 0))
        tl.store(row + 2, tl.sum(adv_pos, 0))
        tl.store(row + 3, tl.sum(adv_neg, 0))
    # counters: [masked tokens, sequences with a masked token, pass-2 ticket, per-sequence "seen" flags...]
    tl.atomic_add(counters_ptr, n)
    has_tokens = (n > 0).to(tl.int32)
    seen_before = tl.atomic_max(counters_ptr + 3 + seq, has_tokens)
    tl.atomic_add(counters_ptr + 1, has_tokens * (seen_before == 0).to(tl.int32))


@triton.jit
def _kl_and_grad(delta, KL_TYPE: tl.constexpr):
    """Sampled-token KL estimate of delta = logp - ref_logp and its derivative in delta."""
    if KL_TYPE == 0:
        kl = delta
        dkl = tl.full(delta.shape, 1.0, tl.float32)
    elif KL_TYPE == 1:
        kl = 0.5 * delta * delta
        dkl = delta
    else:
        # exp(-d) - 1 + d and 1 - exp(-d) cancel catastrophically in fp32 for small d: use the series there
        small = tl.abs(delta) < 1e-2
        e = tl.exp(-delta)
        kl = tl.where(small, delta * delta * (0.5 - delta * (1.0 / 6.0 - delta / 24.0)), e - 1.0 + delta)
        dkl = tl.where(small, delta * (1.0 - delta * (0.5 - delta * (1.0 / 6.0 - delta / 24.0))), 1.0 - e)
        if KL_TYPE == 3:
            dkl = tl.where((kl < -10.0) | (kl > 10.0), 0.0, dkl)
            kl = tl.minimum(tl.maximum(kl, -10.0), 10.0)
    return kl, dkl


@triton.jit
def _token_loss_kernel(logp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, rollout_ptr, entropy_ptr, cu_seqlens_ptr,
                       seq_stats_ptr, counters_ptr, prog_sums_ptr, loss_ptr, metrics_ptr, dlogp_ptr, dentropy_ptr,
                       num_tokens, num_seqs, HAS_CU: tl.constexpr, ESTIMATOR: tl.constexpr,
                       CLIP_LOW: tl.constexpr, CLIP_HIGH: tl.constexpr, DUAL: tl.constexpr,
                       CLIP_C: tl.constexpr, HAS_REF: tl.constexpr, KL_TYPE: tl.constexpr,
                       KL_COEF: tl.constexpr, HAS_ENTROPY: tl.constexpr, ENTROPY_COEF: tl.constexpr,
                       TIS: tl.constexpr, TIS_LOW: tl.constexpr, TIS_HIGH: tl.constexpr, AGG: tl.constexpr,
                       AGG_CONSTANT: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       REDUCE_ROWS: tl.constexpr):
    seq = tl.program_id(0)
    part = tl.program_id(1)
    start, end = _sequence_span(cu_seqlens_ptr, seq, num_tokens, HAS_CU)
    stats = seq_stats_ptr + (seq * SPLIT + tl.arange(0, SPLIT)) * 4
    n = tl.sum(tl.load(stats), 0)
    token_scale = 1.0 / tl.maximum(tl.load(counters_ptr).to(tl.float32), 1.0)
    nonempty = tl.maximum(tl.load(counters_ptr + 1).to(tl.float32), 1.0)
    # d loss / d (masked token's x_t): the aggregation's weight of every token of this sequence
    if AGG == 0:
        scale = token_scale
    elif AGG == 1:
        scale = 1.0 / (nonempty * tl.maximum(n, 1.0))
    elif AGG == 2:
        scale = 1.0 / nonempty
    else:
        scale = token_scale * 0.0 + 1.0 / (num_seqs * AGG_CONSTANT)
    if ESTIMATOR == 1:
        seq_ratio = tl.exp(tl.sum(tl.load(stats + 1), 0) / tl.maximum(n, 1.0))
        # A > 0 tokens depend on r unless r > 1+eps_high; A < 0 tokens unless r < 1-eps (or r > eps_clip_c)
        live_neg = seq_ratio >= CLIP_LOW
        if DUAL:
            live_neg = live_neg & (seq_ratio <= CLIP_C)
        pg_dr = -(tl.where(seq_ratio <= CLIP_HIGH, tl.sum(tl.load(stats + 2), 0), 0.0)
                  + tl.where(live_neg, tl.sum(tl.load(stats + 3), 0), 0.0))
        # d(Σ_t pg_t)/d logp_u for each masked token u: dr/dlogp_u = r / n
        seq_dpg = pg_dr * seq_ratio / tl.maximum(n, 1.0)
    acc_loss = tl.zeros([BLOCK], tl.float32)
    acc_pg = tl.zeros([BLOCK], tl.float32)
    acc_kl = tl.zeros([BLOCK], tl.float32)
    acc_entropy = tl.zeros([BLOCK], tl.float32)
    acc_clipped = tl.zeros([BLOCK], tl.float32)
    acc_approx_kl = tl.zeros([BLOCK], tl.float32)
    acc_tis = tl.zeros([BLOCK], tl.float32)
    acc_tis_outside = tl.zeros([BLOCK], tl.float32)
    for block_start in range(start + part * BLOCK, end, SPLIT * BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        in_seq = offs < end
        m = in_seq & (tl.load(mask_ptr + offs, mask=in_seq, other=0) != 0)
        # masked-out tokens read as 0 so nothing below can overflow there
        logp = tl.load(logp_ptr + offs, mask=m, other=0.0)
        old = tl.load(old_ptr + offs, mask=m, other=0.0)
        adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
        if ESTIMATOR == 1:
            ratio = tl.zeros([BLOCK], tl.float32) + seq_ratio
        else:
            ratio = tl.exp(logp - old)
        clipped_ratio = tl.minimum(tl.maximum(ratio, CLIP_LOW), CLIP_HIGH)
        if ESTIMATOR == 2:
            pg = -clipped_ratio * adv * logp
            clipped = clipped_ratio != ratio
            dpg = -clipped_ratio * adv
        else:
            unclipped_loss = -ratio * adv
            clipped_loss = -clipped_ratio * adv
            pg = tl.maximum(unclipped_loss, clipped_loss)
            clipped = clipped_loss > unclipped_loss
            if DUAL:
                dual_loss = -CLIP_C * adv
                dual = (adv < 0) & (dual_loss < pg)
                pg = tl.where(dual, dual_loss, pg)
                clipped = clipped | dual
            dpg = tl.where(clipped, 0.0, unclipped_loss)  # d pg / d log-ratio = -A·r where unclipped
        if TIS != 0:
            rollout = tl.load(rollout_ptr + offs, mask=m, other=0.0)
            w, tis_outside = _tis_weight(old, rollout, TIS, TIS_LOW, TIS_HIGH)
            pg = pg * w
            dpg = dpg * w
            acc_tis += tl.where(m, w, 0.0)
            acc_tis_outside += (m & tis_outside).to(tl.float32)
        else:
            acc_tis += m.to(tl.float32)
        x = pg
        if ESTIMATOR == 1:
            dx = tl.zeros([BLOCK], tl.float32) + seq_dpg  # pg reaches logp only via the sequence ratio
        else:
            dx = dpg
        if HAS_REF:
            kl, dkl = _kl_and_grad(logp - tl.load(ref_ptr + offs, mask=m, other=0.0), KL_TYPE)
            x += KL_COEF * kl
            dx += KL_COEF * dkl
            acc_kl += tl.where(m, scale * kl, 0.0)
        if HAS_ENTROPY:
            entropy = tl.load(entropy_ptr + offs, mask=m, other=0.0)
            x -= ENTROPY_COEF * entropy
            acc_entropy += tl.where(m, scale * entropy, 0.0)
        dlogp = scale * dx
        tl.store(dlogp_ptr + offs, tl.where(m, dlogp, 0.0), mask=in_seq)
        tl.store(dentropy_ptr + offs, tl.where(m, -ENTROPY_COEF * scale, 0.0), mask=in_seq)
        acc_loss += tl.where(m, scale * x, 0.0)
        acc_pg += tl.where(m, scale * pg, 0.0)
        acc_clipped += (m & clipped).to(tl.float32)
        acc_approx_kl += tl.where(m, old - logp, 0.0)
    # one reduction of a [BLOCK, 8] tile instead of eight: column k holds accumulator k
    cols = tl.arange(0, 8)
    tile = tl.where(cols[None, :] == 0, acc_loss[:, None], 0.0)
    tile += tl.where(cols[None, :] == 1, acc_pg[:, None], 0.0)
    tile += tl.where(cols[None, :] == 2, acc_kl[:, None], 0.0)
    tile += tl.where(cols[None, :] == 3, acc_entropy[:, None], 0.0)
    tile += tl.where(cols[None, :] == 4, acc_clipped[:, None], 0.0)
    tile += tl.where(cols[None, :] == 5, acc_approx_kl[:, None], 0.0)
    tile += tl.where(cols[None, :] == 6, acc_tis[:, None], 0.0)
    tile += tl.where(cols[None, :] == 7, acc_tis_outside[:, None], 0.0)
    sums = tl.sum(tile, 0)
    num_programs = num_seqs * SPLIT
    tl.store(prog_sums_ptr + (seq * SPLIT + part) * 8 + cols, sums)
    # all of this program's stores are issued before the (acq_rel) ticket publishes them
    tl.debug_barrier()
    ticket = tl.atomic_add(counters_ptr + 2, 1)
    if ticket == num_programs - 1:
        total = tl.zeros([REDUCE_ROWS, 8], tl.float32)
        for row0 in range(0, num_programs, REDUCE_ROWS):
            rows = row0 + tl.arange(0, REDUCE_ROWS)
            total += tl.load(prog_sums_ptr + rows[:, None] * 8 + cols[None, :], mask=rows[:, None] < num_programs,
                             other=0.0, volatile=True)
        result = tl.sum(total, 0)
        result = tl.where(cols >= 4, result * token_scale, result)  # columns 4.. are token-means
        tl.store(loss_ptr + cols, result, mask=cols == 0)
        tl.store(metrics_ptr + cols - 1, result, mask=cols > 0)


def _launch_shape(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """(BLOCK, SPLIT): blocks about one average sequence long (64..1024), about one block per program."""
    average = -(-num_tokens // num_seqs)
    block = min(1024, max(64, 1 << max(average - 1, 0).bit_length()))
    blocks_per_seq = -(-average // block)
    split = min(MAX_SPLIT, 1 << max(blocks_per_seq - 1, 0).bit_length())
    return block, split


def policy_loss_grads_triton(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                             entropy=None, cu_seqlens=None, block=None, split=None):
    """The Triton path of ``policy_loss_grads`` on already-checked inputs (CUDA, or CPU with TRITON_INTERPRET=1).

    ``block`` (tokens per step) and ``split`` (programs per sequence), powers of two, override the launch shape
    picked from T and S. Returns ``(loss [] fp32, metrics [7] fp32 in METRIC_NAMES order,
    dloss_dlogp [T] fp32, dloss_dentropy [T] fp32)``.
    """
    num_tokens = logp.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"logp has {num_tokens} tokens; the kernel indexes tokens with int32 (max {MAX_TOKENS})")
    num_seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    default_block, default_split = _launch_shape(num_tokens, num_seqs)
    block, split = block or default_block, split or default_split
    for name, value in (("block", block), ("split", split)):
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    # the kernels index every [T] tensor with unit stride
    logp, old_logp, advantages, mask, ref_logp, rollout_logp, entropy = (
        t if t is None else t.contiguous() for t in (logp, old_logp, advantages, mask, ref_logp, rollout_logp, entropy))
    device = logp.device
    counters = torch.zeros(3 + num_seqs, dtype=torch.int32, device=device)
    seq_stats = torch.empty(num_seqs * split * SEQ_STATS, dtype=torch.float32, device=device)
    prog_sums = torch.empty(num_seqs * split * PROGRAM_SUMS, dtype=torch.float32, device=device)
    loss = torch.empty((), dtype=torch.float32, device=device)
    metrics = torch.empty(len(METRIC_NAMES), dtype=torch.float32, device=device)
    dlogp = torch.empty(num_tokens, dtype=torch.float32, device=device)
    dentropy = torch.empty(num_tokens, dtype=torch.float32, device=device)
    # absent optional inputs are never read (their constexpr flag is off); any pointer does
    ref, rollout, ent = (t if t is not None else logp for t in (ref_logp, rollout_logp, entropy))
    cu = cu_seqlens if cu_seqlens is not None else counters
    tis = TIS_IDS[cfg.tis]
    tis_low, tis_high = (float(cfg.tis_clip_low), float(cfg.tis_clip)) if tis else (0.0, 0.0)
    grid = (num_seqs, split)
    _sequence_stats_kernel[grid](logp, old_logp, advantages, mask, rollout, cu, seq_stats, counters, num_tokens,
                                 HAS_CU=cu_seqlens is not None, GSPO=cfg.estimator == "gspo", TIS=tis,
                                 TIS_LOW=tis_low, TIS_HIGH=tis_high, SPLIT=split, BLOCK=block)
    _token_loss_kernel[grid](logp, old_logp, advantages, mask, ref, rollout, ent, cu, seq_stats, counters, prog_sums,
                             loss, metrics, dlogp, dentropy, num_tokens, num_seqs, HAS_CU=cu_seqlens is not None,
                             ESTIMATOR=ESTIMATOR_IDS[cfg.estimator], CLIP_LOW=1.0 - cfg.eps_clip,
                             CLIP_HIGH=1.0 + cfg.eps_clip_high, DUAL=cfg.eps_clip_c is not None,
                             CLIP_C=float(cfg.eps_clip_c or 0.0), HAS_REF=ref_logp is not None,
                             KL_TYPE=KL_TYPE_IDS[cfg.kl_type], KL_COEF=float(cfg.kl_coef),
                             HAS_ENTROPY=entropy is not None, ENTROPY_COEF=float(cfg.entropy_coef), TIS=tis,
                             TIS_LOW=tis_low, TIS_HIGH=tis_high, AGG=AGG_IDS[cfg.agg],
                             AGG_CONSTANT=float(cfg.agg_constant or 0.0), SPLIT=split, BLOCK=block,
                             REDUCE_ROWS=128)
    return loss, metrics, dlogp, dentropy
