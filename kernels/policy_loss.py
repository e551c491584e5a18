"""RL policy loss (PPO / GSPO / CISPO + KL + entropy + TIS, four aggregations) with its gradients in one pass.

The exact math is ``redline.kernels.reference.policy_loss_reference``; this module computes the same loss
and, in the same forward, ``d loss / d logp`` and ``d loss / d entropy`` per token, so backward is a scale.

GPU path: two Triton launches (plus one memset of a small counter buffer), no host sync. The grid is
``(S, SPLIT)``: program (i, j) handles blocks j, j+SPLIT, ... of sequence i, so long sequences are spread over
SPLIT programs and short ones get one each.
  pass 1  per-program partials of sequence i (masked-token count; gspo: Σ log-ratio and Σ w·A split by the
          sign of A) and two integer atomics: the batch's masked-token count and its count of sequences with
          at least one masked token.
  pass 2  sums the partials of its sequence in a fixed order, computes per-token loss and gradients, writes
          its partial sums of loss and metrics, and the last program to finish (an atomic ticket) reduces them
          in program order. Every float sum has a fixed order, so results are bitwise reproducible.
gspo's ratio is per sequence, and whether a token's loss still depends on it (not clipped) is decided by the
sign of its advantage alone, so Σ_t w_t·∂pg_t/∂r — the sum the gradient needs — comes from pass 1's two
signed sums; no third pass.

CPU path: the reference in fp32 with ``torch.autograd.grad`` (vectorised PyTorch). The Triton kernel also runs
on CPU tensors under ``TRITON_INTERPRET=1`` (call ``policy_loss_grads_triton`` directly; the tests do).

Both paths are one ``torch.library`` custom op (``redline::policy_loss``), so ``torch.compile`` treats the
call as opaque instead of breaking the graph or tracing into Triton, and config scalars reach the kernels as
``tl.constexpr`` (never as Inductor-promoted fp64 arguments).
"""

import dataclasses
import functools

import torch

from redline.extras import available, require
from redline.kernels.loss_config import LossConfig, check_policy_loss_inputs
from redline.kernels.reference import METRIC_NAMES, kl_estimate, sequence_index

ESTIMATOR_IDS = {"ppo": 0, "gspo": 1, "cispo": 2}
KL_TYPE_IDS = {"k1": 0, "k2": 1, "k3": 2, "low_var_kl": 3}
TIS_IDS = {None: 0, "truncate": 1, "icepop": 2}
AGG_IDS = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
SEQ_STATS = 4  # pass-1 partials per program: count, Σ log-ratio, Σ w·A (A > 0), Σ w·A (A < 0)
OUTPUTS = 1 + len(METRIC_NAMES)  # loss, then the metrics in METRIC_NAMES order
MAX_SPLIT = 256
MAX_TOKENS = 2**31 - 1  # token offsets are int32 in the kernels

if available("triton"):
    import triton
    import triton.language as tl

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
        cols = tl.arange(0, 8)
        sums = tl.where(cols == 0, tl.sum(acc_loss, 0), 0.0)
        sums += tl.where(cols == 1, tl.sum(acc_pg, 0), 0.0)
        sums += tl.where(cols == 2, tl.sum(acc_kl, 0), 0.0)
        sums += tl.where(cols == 3, tl.sum(acc_entropy, 0), 0.0)
        sums += tl.where(cols == 4, tl.sum(acc_clipped, 0), 0.0)
        sums += tl.where(cols == 5, tl.sum(acc_approx_kl, 0), 0.0)
        sums += tl.where(cols == 6, tl.sum(acc_tis, 0), 0.0)
        sums += tl.where(cols == 7, tl.sum(acc_tis_outside, 0), 0.0)
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
    require("triton", "the Triton policy-loss kernel")
    num_tokens = logp.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"logp has {num_tokens} tokens; the kernel indexes tokens with int32 (max {MAX_TOKENS})")
    num_seqs = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    default_block, default_split = _launch_shape(num_tokens, num_seqs)
    block, split = block or default_block, split or default_split
    for name, value in (("block", block), ("split", split)):
        if value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    device = logp.device
    counters = torch.zeros(3 + num_seqs, dtype=torch.int32, device=device)
    seq_stats = torch.empty(num_seqs * split * SEQ_STATS, dtype=torch.float32, device=device)
    prog_sums = torch.empty(num_seqs * split * 8, dtype=torch.float32, device=device)
    loss = torch.empty((), dtype=torch.float32, device=device)
    metrics = torch.empty(len(METRIC_NAMES), dtype=torch.float32, device=device)
    dlogp = torch.empty_like(logp)
    dentropy = torch.empty_like(logp)
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


def policy_loss_grads_torch(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                            entropy=None, cu_seqlens=None):
    """The CPU path of ``policy_loss_grads``: the kernels' math (gradients derived by hand, as in the kernel) in
    vectorised PyTorch. Autograd cannot record inside a custom op, hence no reference + autograd here.
    Same returns as ``policy_loss_grads_triton``."""
    seq, num_seqs = sequence_index(cu_seqlens, logp.shape[0], logp.device)
    zeros = torch.zeros_like(logp)
    weights = mask.to(logp.dtype)
    old_logp, advantages = torch.where(mask, old_logp, zeros), torch.where(mask, advantages, zeros)
    logp = torch.where(mask, logp, zeros)  # masked-out tokens read as 0, as in the kernel: nothing can overflow

    def per_seq(x):
        return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, x)

    tokens_per_seq = per_seq(weights)
    token_scale = 1 / weights.sum().clamp(min=1)
    nonempty = (tokens_per_seq > 0).sum().clamp(min=1)
    if cfg.agg == "token-mean":
        scale = token_scale.expand(num_seqs)
    elif cfg.agg == "seq-mean-token-mean":
        scale = 1 / (nonempty * tokens_per_seq.clamp(min=1))
    elif cfg.agg == "seq-mean-token-sum":
        scale = (1 / nonempty).expand(num_seqs)
    else:
        scale = torch.full((num_seqs,), 1 / (num_seqs * cfg.agg_constant), device=logp.device)
    scale = torch.where(mask, scale.to(logp.dtype)[seq], zeros)  # d loss / d x_t
    if cfg.tis is None:
        tis_weight, tis_outside = weights, torch.zeros_like(mask)
    else:
        w = torch.exp(old_logp - torch.where(mask, rollout_logp, zeros))
        tis_outside = mask & ((w < cfg.tis_clip_low) | (w > cfg.tis_clip))
        tis_weight = w.clamp(cfg.tis_clip_low, cfg.tis_clip) if cfg.tis == "truncate" else torch.where(tis_outside, 0, w)
    if cfg.estimator == "gspo":
        seq_ratio = torch.exp(per_seq(logp - old_logp) / tokens_per_seq.clamp(min=1))
        ratio = seq_ratio[seq]
    else:
        ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_high)
    if cfg.estimator == "cispo":
        pg, clipped, dpg = -clipped_ratio * advantages * logp, clipped_ratio != ratio, -clipped_ratio * advantages
    else:
        unclipped_loss, clipped_loss = -ratio * advantages, -clipped_ratio * advantages
        pg, clipped = torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss
        if cfg.eps_clip_c is not None:
            dual_loss = -cfg.eps_clip_c * advantages
            dual = (advantages < 0) & (dual_loss < pg)
            pg, clipped = torch.where(dual, dual_loss, pg), clipped | dual
        dpg = torch.where(clipped, zeros, unclipped_loss)  # d pg / d log-ratio: -A·r where not clipped
    pg, dpg = pg * tis_weight, dpg * tis_weight
    if cfg.estimator == "gspo":  # every masked token's log-ratio moves its sequence's mean by 1/n
        dpg = (per_seq(dpg) / tokens_per_seq.clamp(min=1))[seq]
    x, dx, kl = pg, dpg, zeros
    if ref_logp is not None:
        delta = logp - torch.where(mask, ref_logp, zeros)
        kl = kl_estimate(delta, cfg.kl_type)
        if cfg.kl_type == "k1":
            dkl = torch.ones_like(delta)
        elif cfg.kl_type == "k2":
            dkl = delta
        else:
            dkl = -torch.expm1(-delta)
            if cfg.kl_type == "low_var_kl":  # zero where the clamp to [-10, 10] is active
                dkl = torch.where(kl_estimate(delta, "k3").abs() <= 10, dkl, zeros)
        x, dx = x + cfg.kl_coef * kl, dx + cfg.kl_coef * dkl
    ent = torch.where(mask, entropy, zeros) if entropy is not None else zeros
    x = x - cfg.entropy_coef * ent
    token_means = torch.stack([clipped.to(logp.dtype), old_logp - logp, tis_weight, tis_outside.to(logp.dtype)])
    sums = torch.cat([torch.stack([x, pg, kl, ent]) @ scale, torch.where(mask, token_means, 0).sum(1) * token_scale])
    return sums[0].clone(), sums[1:].clone(), scale * dx, -cfg.entropy_coef * scale  # outputs may not alias


CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(LossConfig))


@functools.lru_cache(maxsize=64)
def _config(*values) -> LossConfig:
    return LossConfig(**dict(zip(CONFIG_FIELDS, values)))


# The config travels as plain scalars (not a LossConfig) because a custom op's schema takes only those;
# torch.compile then guards on each value.
@torch.library.custom_op("redline::policy_loss", mutates_args=())
def _policy_loss_op(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    ref_logp: torch.Tensor | None, rollout_logp: torch.Tensor | None, entropy: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, estimator: str, eps_clip: float, eps_clip_high: float,
                    eps_clip_c: float | None, kl_type: str, kl_coef: float, entropy_coef: float, tis: str | None,
                    tis_clip_low: float | None, tis_clip: float | None, agg: str,
                    agg_constant: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _config(estimator, eps_clip, eps_clip_high, eps_clip_c, kl_type, kl_coef, entropy_coef, tis, tis_clip_low,
                  tis_clip, agg, agg_constant)
    impl = policy_loss_grads_triton if logp.device.type == "cuda" else policy_loss_grads_torch
    return impl(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp,
                entropy=entropy, cu_seqlens=cu_seqlens)


@_policy_loss_op.register_fake
def _(logp, *args):
    return (logp.new_empty(()), logp.new_empty(len(METRIC_NAMES)), torch.empty_like(logp), torch.empty_like(logp))


def _setup_context(ctx, inputs, output):
    _, metrics, dlogp, dentropy = output
    ctx.has_entropy = inputs[6] is not None
    ctx.save_for_backward(dlogp, dentropy)
    ctx.mark_non_differentiable(metrics, dlogp, dentropy)


def _backward(ctx, grad_loss, grad_metrics, grad_dlogp, grad_dentropy):
    dlogp, dentropy = ctx.saved_tensors
    grad_entropy = grad_loss * dentropy if ctx.has_entropy else None
    return (grad_loss * dlogp, None, None, None, None, None, grad_entropy, None) + (None,) * len(CONFIG_FIELDS)


torch.library.register_autograd("redline::policy_loss", _backward, setup_context=_setup_context)


def policy_loss_grads(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None,
                      entropy=None, cu_seqlens=None):
    """The policy loss and its per-token gradients, computed together (the fused LM-head chains these).

    Inputs as ``policy_loss``. Returns ``(loss [] fp32, metrics {name: [] fp32}, dloss_dlogp [T] fp32,
    dloss_dentropy [T] fp32)``; the gradients are of the returned (unscaled) loss, zero at masked-out tokens,
    and ``dloss_dentropy`` is ``-entropy_coef·(aggregation weight)`` (zeros when ``entropy`` is None).
    ``loss`` is differentiable w.r.t. ``logp``/``entropy`` like ``policy_loss``'s; the gradients are not.
    """
    check_policy_loss_inputs(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp, rollout_logp=rollout_logp,
                             entropy=entropy, cu_seqlens=cu_seqlens)
    loss, metrics, dlogp, dentropy = _policy_loss_op(logp, old_logp, advantages, mask, ref_logp, rollout_logp,
                                                     entropy, cu_seqlens, *(getattr(cfg, f) for f in CONFIG_FIELDS))
    return loss, dict(zip(METRIC_NAMES, metrics.unbind())), dlogp, dentropy


def policy_loss(logp, old_logp, advantages, mask, *, cfg: LossConfig, ref_logp=None, rollout_logp=None, entropy=None,
                cu_seqlens=None):
    """RL policy loss; the exact math is ``redline.kernels.reference.policy_loss_reference``.

    logp, old_logp, advantages (per token), ref_logp, rollout_logp, entropy: [T] fp32 on one device;
    mask: [T] bool (True = the token is trained on); cu_seqlens: [S+1] int32 sequence boundaries of the
    packed batch (None: the whole batch is one sequence; gspo and the seq-mean aggregations then see S = 1).
    ref_logp is required when cfg.kl_coef != 0, rollout_logp when cfg.tis is set, entropy when
    cfg.entropy_coef != 0; a bad argument raises ValueError naming it.
    Returns ``(loss [] fp32, metrics)``: loss is differentiable w.r.t. logp and entropy; metrics is
    {pg_loss, kl, entropy, clipfrac, approx_kl, tis_mean, tis_clipfrac} of 0-dim fp32 tensors, left on the
    device (no host sync). CUDA tensors run the Triton kernels, CPU tensors the PyTorch path.
    """
    loss, metrics, _, _ = policy_loss_grads(logp, old_logp, advantages, mask, cfg=cfg, ref_logp=ref_logp,
                                            rollout_logp=rollout_logp, entropy=entropy, cu_seqlens=cu_seqlens)
    return loss, metrics
