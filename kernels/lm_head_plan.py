"""How the LM-head paths cut ``[T, V]`` logits into blocks of a bounded workspace, and what each path costs.

Three plans, each ``(token chunk, vocab chunk)`` within ``budget`` bytes of workspace:
  ``forward_plan``   two-pass forward: fp32 logits block → softmax statistics;
  ``backward_plan``  two-pass backward: recomputed fp32 logits block → dz → dHidden, dW;
  ``one_pass_plan``  one pass (the policy loss): a token chunk's full-vocabulary fp32 logits stay in the
                     workspace from the statistics to dz, so nothing is recomputed; ``token_chunk_bounds`` cuts
                     the rows into its chunks (whole sequences per chunk for a sequence-level loss).

The cost model: GEMM FLOPs at ``PEAK_FLOPS`` plus, at ``HBM_BYTES_PER_S`` and with no overlap assumed, the
HBM bytes a path moves besides the GEMMs' compute-bound operand streams — fp32 logits written and read back, dz
written and read, the fp32 dh accumulator and dW read-modify-written per chunk, hidden rows per vocab chunk,
and weight reads a GEMM's FLOPs cannot hide (``_weight_read_bytes``). Fitted on the H100 runs in
``benchmarks/results/lm_head`` (256 MiB): two-pass ``fused_linear_policy_loss`` model 137.2 ms vs measured
137.1 (H=4096, V=151936, T=16384, bf16), 33.9 vs 36.2 at T=4096; ``fused_linear_logprobs`` fwd+bwd 136.6 vs
136.1, 216.5 vs 216.6 at H=8192, V=128256, 79.2 vs 73.6 at H=2048; forward 35.5 vs 36.4. The one-pass path saves
the logits recompute (2·T·H·V FLOPs) but read-modify-writes dW (and re-streams the weight) once per token chunk,
and a chunk holds only about ``budget / (4·V)`` tokens, so it pays only with a large enough workspace
(``choose_one_pass``), and each chunk has a fixed cost (``ONE_PASS_CHUNK_SECONDS``). Measured at the shape
above (``benchmarks/results/lm_head/lm-head-policy-h100-run2``): one pass 160.5 ms vs two passes 140.9 at 256 MiB
(384 tokens a chunk; model 160.2 vs 137.2), 113.0 vs 134.0 at 1 GiB (1472 tokens; model 114.5 vs 132.2); at
T=4096, 53.0 vs 36.9 at 256 MiB and 30.1 vs 36.0 at 1 GiB. The model picks the faster path in all four. For gspo
(``seq_bounds``) the one-pass chunks hold whole sequences (``token_chunk_bounds``): the model counts those chunks
and charges each as one of their mean length — the same terms, not fitted to a gspo measurement.

Pure arithmetic, no Triton import: the CPU path takes the same decision (its own costs differ; it serves tests
and small models).
"""

import itertools
import math

PEAK_FLOPS = 750e12  # bf16 cuBLAS GEMMs of these shapes on an H100 (the three bare GEMMs: 717 TFLOP/s measured)
HBM_BYTES_PER_S = 3.0e12  # H100 HBM3, achievable
# Fixed cost of one one-pass token chunk beyond its bytes and FLOPs (~20 Triton launches, ~100 small torch ops,
# the chunk's policy-loss call). Fitted to the H100 run (lm-head-policy-h100-run2): without it the model said
# 134 ms at 256 MiB (384-token chunks) where 160.5 ms was measured, 107 vs 113 ms at 1 GiB (1472-token chunks).
ONE_PASS_CHUNK_SECONDS = 0.6e-3
# Token-chunk granularity with fused statistics GEMMs (``piece``), where the budget allows it: the CuTe GEMM's
# 256-row tiles in two-CTA clusters (Triton's fused statistics GEMM, 128-row tiles, follows it too, unmeasured). Measured on the H100 (``benchmarks/results/lm_head/lm-head-cute-h100/plans``,
# one-pass GRPO, H=4096, V=151936, T=16384): 2048- and 2560-token chunks 97.7–98.9 ms, 2304 and 2496 (a ragged
# cluster) 104.5–106.8.
FUSED_TOKEN_ALIGN = 512


def round_down(x: int, k: int) -> int:
    """The largest multiple of ``k`` ≤ x, but at least k."""
    return max(k, x // k * k)


def round_up(x: int, k: int) -> int:
    """The smallest multiple of ``k`` ≥ x (a row padded to ``k`` elements)."""
    return -(-x // k) * k


# Per token and vocab piece of a forward token chunk: its [5, t, pieces] fp32 partial statistics and the
# temporaries ``vocab_stats.combine`` makes while merging them (six [t, pieces] fp32 at most).
PIECE_BYTES = 4 * 11
# Per selected row, held through the call besides the workspace: the forward's [5, R] fp32 merged statistics,
# the backward's saved lse, and with a row mask the gathered [R] fp32 inputs and the row index.
ROW_BYTES = 20
GATHERED_ROW_BYTES = 24
TARGET_BYTES = 8  # per token of a chunk: its int64 target ids, shifted to the vocab shard


def row_bytes(n_rows: int, gather: bool) -> int:
    """Bytes of per-row state (``ROW_BYTES``, ``GATHERED_ROW_BYTES``): what a plan's budget leaves free so
    that the whole call stays within it."""
    return n_rows * (ROW_BYTES + (GATHERED_ROW_BYTES if gather else 0))


def _pieces(vocab: int, vocab_chunk: int) -> int:
    return -(-vocab // vocab_chunk)


def forward_plan(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int, align: int,
                 piece: int | None = None):
    """(token chunk, vocab chunk): fp32 logits block, the chunk's partial statistics (``PIECE_BYTES``) and
    gathered hidden rows within ``budget`` bytes less the per-row state (``row_bytes``).

    As many tokens as leave room for a vocab chunk of 8·align columns (2048 on the GPU), then the longest
    vocab chunk that fits: long vocab chunks keep the GEMMs large and the weight is streamed once per token
    chunk. ``piece``: the statistics come straight from the GEMM (``lm_head_gemm_triton``), one piece per
    ``piece`` columns and no logits block: the whole vocabulary per token chunk, as many tokens as fit.
    """
    budget = max(0, budget - row_bytes(n_rows, gather))
    hidden_row = itemsize * width if gather else 0
    if piece is not None:
        per_token = PIECE_BYTES * _pieces(vocab, piece) + hidden_row + TARGET_BYTES
        fit = budget // per_token
        return min(n_rows, round_down(fit, FUSED_TOKEN_ALIGN if fit >= FUSED_TOKEN_ALIGN else align)), vocab
    per_token = 4 * 8 * align + PIECE_BYTES * _pieces(vocab, 8 * align) + hidden_row + TARGET_BYTES
    token_chunk = min(n_rows, round_down(budget // per_token, align))
    spare = max(0, budget - token_chunk * (hidden_row + TARGET_BYTES))
    vocab_chunk = min(vocab, round_down(spare // (4 * token_chunk), align))
    while vocab_chunk > align and token_chunk * (4 * vocab_chunk + PIECE_BYTES * _pieces(vocab, vocab_chunk)) > spare:
        vocab_chunk -= align
    return token_chunk, vocab_chunk


def backward_plan(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int, align: int,
                  keeps_logits: bool = True):
    """(token chunk, vocab chunk) for the two-pass backward within ``budget`` bytes, the per-row state
    (``row_bytes``) included.

    Per token of a chunk: the fp32 dh accumulator (4·H) and, with a row mask, the gathered hidden row and dh cast
    to the input dtype for the scatter; at most a quarter of the budget. Per logit of a block: fp32 logits (4 B,
    unless ``keeps_logits`` is False: recompute and dz fused, ``lm_head_gemm_triton``) + dz in the input dtype,
    in what is left after the per-row state. The split trades the dh accumulator's read-modify-write per vocab chunk
    (T·H·8·V/vocab_chunk bytes) against dW's per token chunk (T/token_chunk·V·H·4 bytes); a quarter is near
    the minimum of the sum at H=4096, V=151936 (18.6 GB of traffic at T=16384 against 33 GB with half).
    """
    per_token = width * (4 + (2 * itemsize if gather else 0))
    token_chunk = min(n_rows, round_down((budget // 4) // per_token, align))
    spare = max(0, budget - row_bytes(n_rows, gather) - token_chunk * (per_token + TARGET_BYTES))
    per_logit = (4 if keeps_logits else 0) + itemsize
    return token_chunk, min(vocab, round_down(spare // (per_logit * token_chunk), align))


def _seconds(flops: float, hbm_bytes: float) -> float:
    return flops / PEAK_FLOPS + hbm_bytes / HBM_BYTES_PER_S


def _weight_read_bytes(n_rows, vocab, width, itemsize, token_chunk, token_chunks=None) -> float:
    """HBM bytes of one GEMM streaming the whole weight once per token chunk, as far as its FLOPs do not hide
    them: a chunk of M tokens does 2·M·H·V FLOPs per V·H·itemsize bytes, so from M ≈ 250 on (bf16, H100) the
    read costs nothing extra. Fitted: counting these reads in full overestimated the measured two-pass times
    by 3–5 %, leaving them out matches them within 0.5 % (H=4096 and 8192, T=16384). ``token_chunks``: the
    number of chunks when it is not ``⌈T / token chunk⌉`` (sequence-aligned chunks; ``token_chunk`` then their
    mean length)."""
    token_chunks = token_chunks or math.ceil(n_rows / token_chunk)
    read = vocab * width * itemsize / HBM_BYTES_PER_S
    hidden_by = 2 * token_chunk * width * vocab / PEAK_FLOPS
    return token_chunks * max(0.0, read - hidden_by) * HBM_BYTES_PER_S


def _gradient_gemm_bytes(n_rows, vocab, width, itemsize, token_chunk, vocab_chunk, token_chunks=None) -> float:
    """HBM bytes of the logits → dHidden, dW GEMMs beyond the logits and dz: the weight read by the logits
    and dh GEMMs (``_weight_read_bytes``); per token chunk dW written (and read back when accumulating); per
    vocab chunk the hidden rows read by the logits and dW GEMMs and the fp32 dh accumulator read-modify-written.
    ``token_chunks`` as ``_weight_read_bytes``."""
    token_chunks = token_chunks or math.ceil(n_rows / token_chunk)
    vocab_chunks = math.ceil(vocab / vocab_chunk)
    weight = vocab * width * itemsize
    rows = n_rows * width
    return (2 * _weight_read_bytes(n_rows, vocab, width, itemsize, token_chunk, token_chunks)
            + (2 * token_chunks - 1) * weight
            + 2 * vocab_chunks * rows * itemsize + (2 * vocab_chunks - 1) * rows * 4)


def two_pass_seconds(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int,
                     align: int, piece: int | None = None) -> float:
    """Modelled time of forward statistics (2·T·H·V) + recompute backward (6·T·H·V). ``piece``: the fused
    GEMMs (``lm_head_gemm_triton``, statistics per ``piece`` columns): no fp32 logits cross HBM."""
    fp32_round_trip = 0 if piece else 8  # bytes per logit: fp32 written by cuBLAS, read back by the epilogue
    tc, vc = forward_plan(n_rows, vocab, width, gather, itemsize, budget, align, piece=piece)
    forward = (_weight_read_bytes(n_rows, vocab, width, itemsize, tc)
               + math.ceil(vocab / vc) * n_rows * width * itemsize
               + n_rows * vocab * fp32_round_trip)
    tc, vc = backward_plan(n_rows, vocab, width, gather, itemsize, budget, align, keeps_logits=piece is None)
    backward = (_gradient_gemm_bytes(n_rows, vocab, width, itemsize, tc, vc)
                + n_rows * vocab * (fp32_round_trip + 3 * itemsize))  # (+) dz written, read by 2 GEMMs
    return _seconds(8 * n_rows * width * vocab, forward + backward)


def _kept_bytes_per_token(vocab: int, itemsize: int, piece: int | None) -> int:
    """A one-pass token's kept logits: fp32 (cuBLAS), or with the fused GEMM (statistics per ``piece`` columns)
    offsets from each piece's max — fp16 for 2-byte inputs, fp32 for fp32 — rows padded to 8, plus the token's
    ``[5, pieces]`` fp32 statistics and the temporaries of merging them (``PIECE_BYTES``; without them the
    one-pass GRPO loss measured 266 MiB in a 256 MiB workspace on the H100, H=2048, V=65536)."""
    if piece is None:
        return 4 * vocab
    return (2 if itemsize == 2 else 4) * round_up(vocab, 8) + PIECE_BYTES * _pieces(vocab, piece)


def token_chunk_bounds(n_rows: int, token_chunk: int, seq_bounds=None) -> list[int] | None:
    """Boundaries ``[0, …, n_rows]`` of the one-pass token chunks: chunk k holds rows ``bounds[k]`` to
    ``bounds[k+1] − 1``, none empty, at most ``token_chunk`` rows each.

    Without ``seq_bounds``: every ``token_chunk`` rows. ``seq_bounds``: the sequences' boundaries among the rows
    (non-decreasing from 0 to ``n_rows``; empty sequences allowed); each chunk then holds as many whole sequences
    as fit, filled in order — the fewest chunks any cut on sequence boundaries gives — or None when one sequence
    alone is longer than ``token_chunk``.
    """
    if seq_bounds is None:
        return list(range(0, n_rows, token_chunk)) + [n_rows]
    bounds, last = [0], 0  # last: the latest sequence boundary, where the open chunk may end
    for b in seq_bounds[1:]:
        if b - bounds[-1] > token_chunk:
            if b - last > token_chunk:
                return None
            bounds.append(last)
        last = b
    return bounds if bounds[-1] == n_rows else bounds + [n_rows]


def max_chunk(bounds) -> int:
    """Rows of the longest chunk of ``bounds`` (``token_chunk_bounds``), 0 with none: the workspace's size."""
    return max((b - a for a, b in itertools.pairwise(bounds)), default=0)


def _one_pass_candidates(n_rows, vocab, width, gather, itemsize, budget, align, piece):
    """Each ``(token chunk, vocab chunk)`` the one-pass path can run within ``budget`` (see ``one_pass_plan``)."""
    token_align = FUSED_TOKEN_ALIGN if piece else max(1, align // 4)
    for vc in sorted({min(vocab, align << k) for k in range(64) if (align << k) < 2 * vocab}):
        per_token = (_kept_bytes_per_token(vocab, itemsize, piece) + itemsize * vc
                     + width * (4 + (2 * itemsize if gather else 0)))
        fit = budget // per_token
        tc = min(n_rows, fit // token_align * token_align if fit >= token_align else fit)
        if tc > 0:
            yield tc, vc


def one_pass_plan(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int, align: int,
                  piece: int | None = None, seq_bounds=None):
    """(token chunk, vocab chunk) of the one-pass path, or None when not even one token's logits fit — or, with
    ``seq_bounds`` (``token_chunk_bounds``: chunks of whole sequences), when no token chunk holds the longest
    sequence.

    Per token of a chunk: its full-vocabulary logits (``_kept_bytes_per_token``), one vocab chunk of dz in the
    input dtype, the fp32 dh accumulator (4·H) and, with a row mask, the gathered hidden row and dh cast to the
    input dtype for the scatter. Token chunks are multiples of align/4 (64 on the GPU), or of FUSED_TOKEN_ALIGN
    with fused statistics GEMMs where at least that many fit; the vocab chunk (a multiple of align, or all of V) is
    the one the model rates fastest: longer ones cut the dh read-modify-writes, shorter ones leave room for more
    tokens.
    """
    best, best_seconds = None, math.inf
    for tc, vc in _one_pass_candidates(n_rows, vocab, width, gather, itemsize, budget, align, piece):
        seconds = _one_pass_seconds(n_rows, vocab, width, itemsize, tc, vc, piece, seq_bounds)
        if seconds <= best_seconds and seconds < math.inf:  # inf: a sequence longer than tc
            best, best_seconds = (tc, vc), seconds
    return best


def one_pass_token_capacity(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int,
                            align: int, piece: int | None = None) -> int:
    """The most rows one one-pass token chunk can hold within ``budget`` (0: not even one): the longest sequence
    a sequence-level loss can take in one pass."""
    return max((tc for tc, _ in _one_pass_candidates(n_rows, vocab, width, gather, itemsize, budget, align, piece)),
               default=0)


def _one_pass_seconds(n_rows, vocab, width, itemsize, token_chunk, vocab_chunk, piece=None, seq_bounds=None) -> float:
    """Modelled time of one plan; ``inf`` when ``seq_bounds`` do not fit its token chunk. With ``seq_bounds`` the
    chunks are ``token_chunk_bounds``'s — more of them, holding fewer tokens on average, than ⌈T / token chunk⌉
    — and each is charged as one of their mean length (dW read-modify-written, weight streamed, fixed cost per
    chunk)."""
    chunks = math.ceil(n_rows / token_chunk)
    if seq_bounds is not None:
        bounds = token_chunk_bounds(n_rows, token_chunk, seq_bounds)
        if bounds is None:
            return math.inf
        chunks = len(bounds) - 1
        token_chunk = n_rows / chunks
    # kept logits: fp32 written, read by the statistics and dz kernels (fused: fp16 written, read by dz); dz
    # written, read by 2 GEMMs
    kept = (4 if itemsize == 2 else 8) if piece else 12
    hbm_bytes = (_gradient_gemm_bytes(n_rows, vocab, width, itemsize, token_chunk, vocab_chunk, chunks)
                 + n_rows * vocab * (kept + 3 * itemsize))
    return _seconds(6 * n_rows * width * vocab, hbm_bytes) + chunks * ONE_PASS_CHUNK_SECONDS


def one_pass_seconds(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int,
                     align: int, piece: int | None = None, seq_bounds=None) -> float:
    """Modelled time of the one-pass path (6·T·H·V); ``inf`` when it does not fit the budget (with
    ``seq_bounds``: when no token chunk holds the longest sequence)."""
    plan = one_pass_plan(n_rows, vocab, width, gather, itemsize, budget, align, piece, seq_bounds)
    return math.inf if plan is None else _one_pass_seconds(n_rows, vocab, width, itemsize, *plan, piece, seq_bounds)


def choose_one_pass(n_rows: int, vocab: int, width: int, gather: bool, itemsize: int, budget: int,
                    align: int, piece: int | None = None, seq_bounds=None) -> bool:
    """True when the model rates the one-pass path faster than forward + recompute backward (``piece``: both
    with the fused GEMMs). ``seq_bounds``: a sequence-level loss, whose one-pass chunks hold whole sequences
    (``token_chunk_bounds``); False when a sequence is longer than any token chunk."""
    args = (n_rows, vocab, width, gather, itemsize, budget, align, piece)
    return n_rows > 0 and one_pass_seconds(*args, seq_bounds) < two_pass_seconds(*args)
