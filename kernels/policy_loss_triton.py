"""Triton kernels of the policy loss: the loss, its metrics and its per-token gradients in two launches.

The math is ``redline.kernels.reference.policy_loss_reference``. No host sync; one memset of a small counter
buffer besides the two launches. Both launches run one program per BLOCK consecutive tokens of the packed
batch (grid ``(⌈T/BLOCK⌉,)``), whatever the sequence lengths: every program has the same work, and a long
sequence is spread over as many programs as a short batch of them.
  pass 1  (``_sequence_stats_kernel``) where per-sequence sums are needed (gspo; seq-mean-token-mean):
          each token finds its sequence in ``cu_seqlens`` (binary search), and one segmented scan over the block
          sums masked-token count, log-ratio and w·A split by the sign of A per (block, sequence) piece. The
          pieces of sequence s lie in blocks b_first(s) … b_last(s) and go to slots ``b + s`` — distinct for all
          pieces, consecutive for one sequence. An integer atomic counts the batch's masked tokens (exact in any
          order). The seq-mean aggregations divide by S, every sequence, so no count of non-empty ones.
  pass 2  (``_token_loss_kernel``) per token: its sequence's totals — a sequence lying inside the block has one
          slot; only the block's first and last sequence may span other blocks, and their slot ranges are
          summed in a fixed order — then the loss term, its gradients and the block's partial sums of loss
          and metrics; the last program to finish (an atomic ticket) reduces those in block order. Every float
          sum has a fixed order, so results are bitwise reproducible.
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
SEQ_STATS = 4  # per (block, sequence) slot: masked-token count, Σ log-ratio, Σ w·A (A > 0), Σ w·A (A < 0)
PROGRAM_SUMS = 8  # pass-2 partials per program: loss, then the metrics in METRIC_NAMES order
MIN_BLOCK, MAX_BLOCK = 128, 2048
MAX_TOKENS = 2**31 - 1 - MAX_BLOCK  # token offsets (up to the last block's end) are int32
# slots summed per step for a sequence spanning blocks (tiny under the interpreter, so tests loop)
SLOT_RANGE = 16 if triton.knobs.runtime.interpret else 256


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
def _find_sequence(cu_seqlens_ptr, offs, num_seqs, search_steps):
    """The largest s in [0, S) with cu_seqlens[s] <= offs: the sequence holding token offs (empty ones skipped).
    ``search_steps`` (S's bit length) is a runtime loop bound, not a constexpr: a constexpr would compile the
    kernels again for every power-of-two bucket of sequence counts, inside RL steps (issue 23)."""
    lo = tl.zeros(offs.shape, tl.int32)
    hi = lo + (num_seqs - 1)
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        right = tl.load(cu_seqlens_ptr + mid) <= offs
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    return lo


@triton.jit
def _token_sequence(cu_seqlens_ptr, offs, num_tokens, num_seqs, search_steps, HAS_CU: tl.constexpr):
    """(sequence, its first token, its end) of each token offs; without cu_seqlens the batch is one sequence."""
    if HAS_CU:
        seq = _find_sequence(cu_seqlens_ptr, offs, num_seqs, search_steps)
        start = tl.load(cu_seqlens_ptr + seq)
        end = tl.load(cu_seqlens_ptr + seq + 1)
    else:
        seq = tl.zeros(offs.shape, tl.int32)
        start = seq
        end = seq + num_tokens
    return seq, start, end


@triton.jit
def _segmented_sum(a_n, a_lr, a_pos, a_neg, a_start, b_n, b_lr, b_pos, b_neg, b_start):
    """Combine of a segmented scan: the running sums restart where ``b`` starts a segment."""
    go_on = b_start == 0
    return (tl.where(go_on, a_n + b_n, b_n), tl.where(go_on, a_lr + b_lr, b_lr),
            tl.where(go_on, a_pos + b_pos, b_pos), tl.where(go_on, a_neg + b_neg, b_neg), a_start | b_start)


# the sequence count and search length enter only scalar arithmetic: compiled unspecialized, so a batch with a new
# number of sequences (one, a multiple of 16) compiles nothing inside an RL step
@triton.jit(do_not_specialize=["num_seqs", "search_steps"])
def _sequence_stats_kernel(logp_ptr, old_ptr, adv_ptr, mask_ptr, rollout_ptr, cu_seqlens_ptr, slots_ptr,
                           counters_ptr, num_tokens, num_seqs, search_steps, HAS_CU: tl.constexpr,
                           PER_SEQ: tl.constexpr, GSPO: tl.constexpr, TIS: tl.constexpr, TIS_LOW: tl.constexpr,
                           TIS_HIGH: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    offs = block * BLOCK + lane
    in_range = offs < num_tokens
    m = in_range & (tl.load(mask_ptr + offs, mask=in_range, other=0) != 0)
    # counters: [masked tokens, pass-2 ticket]
    tl.atomic_add(counters_ptr, tl.sum(m.to(tl.int32), 0))
    if PER_SEQ:
        seq, start, end = _token_sequence(cu_seqlens_ptr, offs, num_tokens, num_seqs, search_steps, HAS_CU)
        first = ((offs == start) | (lane == 0)).to(tl.int32)
        last = in_range & ((offs + 1 == end) | (lane == BLOCK - 1))
        count = m.to(tl.float32)
        log_ratio = tl.zeros([BLOCK], tl.float32)
        adv_pos = tl.zeros([BLOCK], tl.float32)
        adv_neg = tl.zeros([BLOCK], tl.float32)
        if GSPO:
            old = tl.load(old_ptr + offs, mask=m, other=0.0)
            adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
            log_ratio = tl.load(logp_ptr + offs, mask=m, other=0.0) - old
            if TIS != 0:
                w, _ = _tis_weight(old, tl.load(rollout_ptr + offs, mask=m, other=0.0), TIS, TIS_LOW, TIS_HIGH)
                adv = adv * w
            adv_pos = tl.where(adv > 0, adv, 0.0)
            adv_neg = tl.where(adv < 0, adv, 0.0)
        count, log_ratio, adv_pos, adv_neg, _ = tl.associative_scan(
            (count, log_ratio, adv_pos, adv_neg, first), 0, _segmented_sum)
        # the last token of each (block, sequence) piece holds the piece's sums
        slot = (block + seq) * 4
        tl.store(slots_ptr + slot, count, mask=last)
        tl.store(slots_ptr + slot + 1, log_ratio, mask=last)
        tl.store(slots_ptr + slot + 2, adv_pos, mask=last)
        tl.store(slots_ptr + slot + 3, adv_neg, mask=last)


@triton.jit
def _sequence_totals(slots_ptr, cu_seqlens_ptr, seq, num_tokens, HAS_CU: tl.constexpr, BLOCK: tl.constexpr,
                     SLOT_RANGE: tl.constexpr):
    """[4] sums of sequence ``seq`` (non-empty) over its slots, in a fixed order: the same bits in every program."""
    if HAS_CU:
        start = tl.load(cu_seqlens_ptr + seq)
        end = tl.load(cu_seqlens_ptr + seq + 1)
    else:
        start = seq * 0
        end = seq * 0 + num_tokens
    first_slot = start // BLOCK + seq
    last_slot = (end - 1) // BLOCK + seq
    cols = tl.arange(0, 4)
    acc = tl.zeros([SLOT_RANGE, 4], tl.float32)
    for slot0 in range(first_slot, last_slot + 1, SLOT_RANGE):
        slots = slot0 + tl.arange(0, SLOT_RANGE)
        acc += tl.load(slots_ptr + slots[:, None] * 4 + cols[None, :], mask=(slots <= last_slot)[:, None], other=0.0)
    return tl.sum(acc, 0)


@triton.jit
def _column(row, k: tl.constexpr):
    """Element k of a [4] row (broadcasts against token vectors)."""
    return tl.sum(tl.where(tl.arange(0, 4) == k, row, 0.0), 0)


@triton.jit(do_not_specialize=["num_seqs", "search_steps"])
def _token_loss_kernel(logp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, rollout_ptr, entropy_ptr, cu_seqlens_ptr,
                       slots_ptr, counters_ptr, prog_sums_ptr, loss_ptr, metrics_ptr, dlogp_ptr, dentropy_ptr,
                       num_tokens, num_seqs, search_steps, HAS_CU: tl.constexpr,
                       PER_SEQ: tl.constexpr, ESTIMATOR: tl.constexpr, CLIP_LOW: tl.constexpr,
                       CLIP_HIGH: tl.constexpr, DUAL: tl.constexpr, CLIP_C: tl.constexpr, HAS_REF: tl.constexpr,
                       KL_TYPE: tl.constexpr, KL_COEF: tl.constexpr, HAS_ENTROPY: tl.constexpr,
                       ENTROPY_COEF: tl.constexpr, TIS: tl.constexpr, TIS_LOW: tl.constexpr,
                       TIS_HIGH: tl.constexpr, AGG: tl.constexpr, AGG_CONSTANT: tl.constexpr,
                       BLOCK: tl.constexpr, SLOT_RANGE: tl.constexpr, REDUCE_ROWS: tl.constexpr):
    block = tl.program_id(0)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_tokens
    m = in_range & (tl.load(mask_ptr + offs, mask=in_range, other=0) != 0)
    token_scale = 1.0 / tl.maximum(tl.load(counters_ptr).to(tl.float32), 1.0)
    if PER_SEQ:
        # each token's sequence totals: one slot for a sequence inside the block; the block's first and last
        # sequence may span other blocks and are summed over their slots
        seq, _, _ = _token_sequence(cu_seqlens_ptr, offs, num_tokens, num_seqs, search_steps, HAS_CU)
        seq_first = tl.min(tl.where(in_range, seq, num_seqs), 0)
        seq_last = tl.max(tl.where(in_range, seq, 0), 0)
        totals_first = _sequence_totals(slots_ptr, cu_seqlens_ptr, seq_first, num_tokens, HAS_CU, BLOCK, SLOT_RANGE)
        totals_last = _sequence_totals(slots_ptr, cu_seqlens_ptr, seq_last, num_tokens, HAS_CU, BLOCK, SLOT_RANGE)
        is_first = seq == seq_first
        is_last = seq == seq_last
        own = (block + seq) * 4
        n = tl.where(is_first, _column(totals_first, 0), tl.where(
            is_last, _column(totals_last, 0), tl.load(slots_ptr + own, mask=in_range, other=0.0)))
    # d loss / d (masked token's x_t): the aggregation's weight of every token of its sequence; the seq-mean
    # modes divide by S, empty sequences included
    if AGG == 0:
        scale = token_scale
    elif AGG == 1:
        scale = 1.0 / (num_seqs * tl.maximum(n, 1.0))
    elif AGG == 2:
        scale = token_scale * 0.0 + 1.0 / num_seqs
    else:
        scale = token_scale * 0.0 + 1.0 / (num_seqs * AGG_CONSTANT)
    if ESTIMATOR == 1:
        log_ratio_sum = tl.where(is_first, _column(totals_first, 1), tl.where(
            is_last, _column(totals_last, 1), tl.load(slots_ptr + own + 1, mask=in_range, other=0.0)))
        pos_sum = tl.where(is_first, _column(totals_first, 2), tl.where(
            is_last, _column(totals_last, 2), tl.load(slots_ptr + own + 2, mask=in_range, other=0.0)))
        neg_sum = tl.where(is_first, _column(totals_first, 3), tl.where(
            is_last, _column(totals_last, 3), tl.load(slots_ptr + own + 3, mask=in_range, other=0.0)))
        seq_ratio = tl.exp(log_ratio_sum / tl.maximum(n, 1.0))
        # A > 0 tokens depend on r unless r > 1+eps_high; A < 0 tokens unless r < 1-eps (or r > eps_clip_c)
        live_neg = seq_ratio >= CLIP_LOW
        if DUAL:
            live_neg = live_neg & (seq_ratio <= CLIP_C)
        pg_dr = -(tl.where(seq_ratio <= CLIP_HIGH, pos_sum, 0.0) + tl.where(live_neg, neg_sum, 0.0))
        # d(Σ_t pg_t)/d logp_u for each masked token u: dr/dlogp_u = r / n
        seq_dpg = pg_dr * seq_ratio / tl.maximum(n, 1.0)
    # masked-out tokens read as 0 so nothing below can overflow there
    logp = tl.load(logp_ptr + offs, mask=m, other=0.0)
    old = tl.load(old_ptr + offs, mask=m, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
    if ESTIMATOR == 1:
        ratio = seq_ratio
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
        w, tis_outside = _tis_weight(old, tl.load(rollout_ptr + offs, mask=m, other=0.0), TIS, TIS_LOW, TIS_HIGH)
        pg = pg * w
        dpg = dpg * w
        tis_applied = tl.where(m, w, 0.0)
        tis_outside = (m & tis_outside).to(tl.float32)
    else:
        tis_applied = m.to(tl.float32)
        tis_outside = tl.zeros([BLOCK], tl.float32)
    x = pg
    if ESTIMATOR == 1:
        dx = tl.zeros([BLOCK], tl.float32) + seq_dpg  # pg reaches logp only via the sequence ratio
    else:
        dx = dpg
    kl_part = tl.zeros([BLOCK], tl.float32)
    if HAS_REF:
        kl, dkl = _kl_and_grad(logp - tl.load(ref_ptr + offs, mask=m, other=0.0), KL_TYPE)
        x += KL_COEF * kl
        dx += KL_COEF * dkl
        kl_part = tl.where(m, scale * kl, 0.0)
    entropy_part = tl.zeros([BLOCK], tl.float32)
    if HAS_ENTROPY:
        entropy = tl.load(entropy_ptr + offs, mask=m, other=0.0)
        x -= ENTROPY_COEF * entropy
        entropy_part = tl.where(m, scale * entropy, 0.0)
    tl.store(dlogp_ptr + offs, tl.where(m, scale * dx, 0.0), mask=in_range)
    tl.store(dentropy_ptr + offs, tl.where(m, -ENTROPY_COEF * scale, 0.0), mask=in_range)
    # one reduction of a [BLOCK, 8] tile instead of eight: column k holds partial sum k
    cols = tl.arange(0, 8)
    tile = tl.where(cols[None, :] == 0, tl.where(m, scale * x, 0.0)[:, None], 0.0)
    tile += tl.where(cols[None, :] == 1, tl.where(m, scale * pg, 0.0)[:, None], 0.0)
    tile += tl.where(cols[None, :] == 2, kl_part[:, None], 0.0)
    tile += tl.where(cols[None, :] == 3, entropy_part[:, None], 0.0)
    tile += tl.where(cols[None, :] == 4, (m & clipped).to(tl.float32)[:, None], 0.0)
    tile += tl.where(cols[None, :] == 5, tl.where(m, old - logp, 0.0)[:, None], 0.0)
    tile += tl.where(cols[None, :] == 6, tis_applied[:, None], 0.0)
    tile += tl.where(cols[None, :] == 7, tis_outside[:, None], 0.0)
    sums = tl.sum(tile, 0)
    num_programs = tl.num_programs(0)
    tl.store(prog_sums_ptr + block * 8 + cols, sums)
    # all of this program's stores are issued before the (acq_rel) ticket publishes them
    tl.debug_barrier()
    ticket = tl.atomic_add(counters_ptr + 1, 1)
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


def _launch_shape(num_tokens: int) -> tuple[int, int]:
    """(BLOCK, num_warps): about 1024 programs at any T (BLOCK 128 … 2048, a power of two)."""
    block = min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(-(-num_tokens // 1024) - 1, 0).bit_length()))
    return block, max(1, min(8, block // 128))


def policy_loss_grads_triton(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                             entropy=None, cu_seqlens=None, block=None):
    """The Triton path of ``policy_loss_grads`` on already-checked inputs (CUDA, or CPU with TRITON_INTERPRET=1).

    ``block`` (tokens per program, a power of two) overrides the one picked from T. Returns ``(loss [] fp32,
    metrics [7] fp32 in METRIC_NAMES order, dloss_dlogp [T] fp32, dloss_dentropy [T] fp32)``.
    """
    num_tokens = logp.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"logp has {num_tokens} tokens; the kernel indexes tokens with int32 (max {MAX_TOKENS})")
    num_seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    default_block, num_warps = _launch_shape(num_tokens)
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block}")
    block = block or default_block
    # the kernels index every [T] tensor with unit stride
    logp, old_logp, advantages, mask, ref_logp, rollout_logp, entropy = (
        t if t is None else t.contiguous() for t in (logp, old_logp, advantages, mask, ref_logp, rollout_logp, entropy))
    device = logp.device
    num_blocks = max(1, triton.cdiv(num_tokens, block))
    counters = torch.zeros(2, dtype=torch.int32, device=device)
    # every slot a pass-2 program reads was written by pass 1 (only non-empty sequences' pieces are read)
    slots = torch.empty((num_blocks + num_seqs) * SEQ_STATS, dtype=torch.float32, device=device)
    prog_sums = torch.empty(num_blocks * PROGRAM_SUMS, dtype=torch.float32, device=device)
    loss = torch.empty((), dtype=torch.float32, device=device)
    metrics = torch.empty(len(METRIC_NAMES), dtype=torch.float32, device=device)
    dlogp = torch.empty(num_tokens, dtype=torch.float32, device=device)
    dentropy = torch.empty(num_tokens, dtype=torch.float32, device=device)
    # absent optional inputs are never read (their constexpr flag is off); any pointer does
    ref, rollout, ent = (t if t is not None else logp for t in (ref_logp, rollout_logp, entropy))
    cu = cu_seqlens if cu_seqlens is not None else counters
    tis = TIS_IDS[cfg.tis]
    tis_low, tis_high = (float(cfg.tis_clip_low), float(cfg.tis_clip)) if tis else (0.0, 0.0)
    gspo = cfg.estimator == "gspo"
    shape = dict(HAS_CU=cu_seqlens is not None,
                 PER_SEQ=gspo or cfg.agg == "seq-mean-token-mean", TIS=tis, TIS_LOW=tis_low,
                 TIS_HIGH=tis_high, BLOCK=block, num_warps=num_warps)
    search_steps = num_seqs.bit_length()
    _sequence_stats_kernel[(num_blocks,)](logp, old_logp, advantages, mask, rollout, cu, slots, counters, num_tokens,
                                          num_seqs, search_steps, GSPO=gspo, **shape)
    _token_loss_kernel[(num_blocks,)](
        logp, old_logp, advantages, mask, ref, rollout, ent, cu, slots, counters, prog_sums, loss, metrics, dlogp,
        dentropy, num_tokens, num_seqs, search_steps, ESTIMATOR=ESTIMATOR_IDS[cfg.estimator], CLIP_LOW=1.0 - cfg.eps_clip,
        CLIP_HIGH=1.0 + cfg.eps_clip_high, DUAL=cfg.eps_clip_c is not None, CLIP_C=float(cfg.eps_clip_c or 0.0),
        HAS_REF=ref_logp is not None, KL_TYPE=KL_TYPE_IDS[cfg.kl_type], KL_COEF=float(cfg.kl_coef),
        HAS_ENTROPY=entropy is not None, ENTROPY_COEF=float(cfg.entropy_coef), AGG=AGG_IDS[cfg.agg],
        AGG_CONSTANT=float(cfg.agg_constant or 0.0), SLOT_RANGE=SLOT_RANGE, REDUCE_ROWS=128, **shape)
    return loss, metrics, dlogp, dentropy
