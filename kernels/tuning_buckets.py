"""Which shapes a run can hand the LM head's autotuned Triton GEMMs, and which micro-batch sizes a start-up
warm-up runs so that no kernel is compiled inside an RL step.

Two things make Triton pay at a call: an autotuned kernel (``lm_head_gemm_triton``) times all its configs the
first time its tuning key — the power-of-two ``bucket`` of the block's rows and of its columns, and the width —
is seen, and every ``@triton.jit`` kernel compiles once per *specialization*: each integer argument is compiled
apart when it equals 1 and when it is a multiple of 16 (``int_class``), each pointer when it is 16-byte aligned.
Token-budget micro-batches hand the kernels every row count from 1 to ``max_tokens_per_gpu`` (the log-prob pass
and the train pass different ones), so the warm-up covers, per power-of-two bucket of rows, each integer class
(``warmup_row_counts``), and the tuning covers each reachable key with one block shape per class of its rows and
columns (``tuning_shapes``). Pure arithmetic on ``lm_head_plan``: no Triton import, CPU-tested.
"""

from collections.abc import Callable, Iterable

from .lm_head_plan import backward_plan, forward_plan, one_pass_plan


def bucket(n: int) -> int:
    """The power of two ≥ n (n ≥ 1): the autotuners' key for a row or column count."""
    if n < 1:
        raise ValueError(f"a row or column count is at least 1, got {n}")
    return 1 << (n - 1).bit_length()


def int_class(n: int) -> str:
    """How Triton specializes an integer kernel argument: ``"1"``, ``"16k"`` (a multiple of 16) or ``"other"``."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "other"


def row_buckets(max_rows: int) -> list[int]:
    """Every power-of-two bucket a count from 1 to ``max_rows`` falls in: 1, 2, 4, …, ``bucket(max_rows)``."""
    return [1 << k for k in range(bucket(max_rows).bit_length())]


def warmup_row_counts(max_rows: int) -> list[int]:
    """Micro-batch sizes (tokens) that together meet every power-of-two bucket from 1 to ``max_rows`` in each
    integer class it holds: per bucket ``(b/2, b]`` (capped at ``max_rows``) its largest count, the one below it,
    the largest multiple of 16, and 17 below the largest — with a top of ``b`` ≥ 256, neither that one nor its
    halves, quarters, eighths and sixteenths (rounded up: the row-block counts the model's kernels derive from the
    token count) are multiples of 16 — ascending."""
    if max_rows < 1:
        raise ValueError(f"max_tokens_per_gpu must be at least 1, got {max_rows}")
    counts = set()
    for b in row_buckets(max_rows):
        top = min(b, max_rows)
        counts.update(n for n in (top, top - 1, top - 17, top // 16 * 16) if b // 2 < n <= top)
    return sorted(counts)


def prefill_shapes(max_prompts: int, max_width: int) -> list[tuple[int, int]]:
    """``(prompts, width)`` batches — ``prompts`` prompts right-padded to ``width`` tokens, ``prompts`` ≤
    ``max_prompts``, ``width`` ≤ ``max_width`` — that meet every integer-class pair ``(int_class(prompts · width),
    int_class(width))`` any such batch reaches, the smallest batch per pair, sorted. A decoding engine's RMSNorm
    sees its ``[prompts, width, H]`` activations as ``prompts · width`` rows in groups of ``width`` (a decode step:
    width 1), and specializes on both counts. Every reachable pair is met with at most 16 prompts (only ``prompts``
    mod 16 decides whether 16 divides ``prompts · width``) and 17 tokens (a width of class ``"other"`` stands in for
    its residue mod 16, 17 for residue 1), so the search stops there."""
    if max_prompts < 1 or max_width < 1:
        raise ValueError(f"prefill_shapes needs at least one prompt of one token, got {max_prompts} prompts of at "
                         f"most {max_width} tokens")
    found: dict[tuple[str, str], tuple[int, int]] = {}
    for width in range(1, min(max_width, 17) + 1):
        for prompts in range(1, min(max_prompts, 16) + 1):
            found.setdefault((int_class(prompts * width), int_class(width)), (prompts, width))
    return sorted(found.values())


def chunk_blocks(n_rows: int, token_chunk: int, vocab: int, vocab_chunk: int) -> set[tuple[int, int]]:
    """The ``(rows, columns)`` blocks a call over ``n_rows`` selected rows runs the GEMM on, cut into token chunks
    of ``token_chunk`` rows (the last one shorter) and vocabulary chunks of ``vocab_chunk`` columns (likewise)."""
    token_chunk = min(token_chunk, n_rows)
    rows = {token_chunk} | ({n_rows % token_chunk} - {0})
    cols = {vocab_chunk} | ({vocab % vocab_chunk} - {0})
    return {(r, c) for r in rows for c in cols}


def tuning_shapes(row_counts: Iterable[int], plans: Callable[[int], Iterable[tuple[int, int]]],
                  vocab: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per tuning key ``(bucket(rows), bucket(columns))`` that calls over ``row_counts`` selected rows reach, one
    block shape ``(rows, columns)`` per integer class pair of that key (the first met), sorted.
    ``plans(n)``: the ``(token chunk, vocab chunk)`` plans a call over n rows may take."""
    found: dict[tuple[int, int], dict[tuple[str, str], tuple[int, int]]] = {}
    for n in row_counts:
        for token_chunk, vocab_chunk in plans(n):
            for r, c in chunk_blocks(n, token_chunk, vocab, vocab_chunk):
                found.setdefault((bucket(r), bucket(c)), {}).setdefault((int_class(r), int_class(c)), (r, c))
    return {key: sorted(shapes.values()) for key, shapes in sorted(found.items())}


def dz_tuning_shapes(min_rows: int, max_rows: int, vocab: int, width: int, itemsize: int, budgets: Iterable[int],
                     align: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """``tuning_shapes`` of the two-pass backward's dz GEMM (``backward_plan`` without kept logits) for every
    selected-row count from ``min_rows`` to ``max_rows``, with and without a row mask, under each workspace
    budget (bytes) the callers use."""
    budgets = tuple(budgets)

    def plans(n):
        return {backward_plan(n, vocab, width, gather, itemsize, b, align, keeps_logits=False)
                for gather in (True, False) for b in budgets}

    return tuning_shapes(range(max(1, min_rows), max_rows + 1), plans, vocab)


def stats_tuning_shapes(max_rows: int, vocab: int, width: int, itemsize: int, budgets: Iterable[int],
                        one_pass_budget: int, align: int, piece: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """``tuning_shapes`` of the statistics GEMM (whole vocabulary per block, statistics per ``piece`` columns): the
    forward (``forward_plan``) under each of ``budgets`` and the one-pass loss (``one_pass_plan``) under
    ``one_pass_budget``, with and without a row mask, for every selected-row count from 1 to ``max_rows``."""
    budgets = tuple(budgets)

    def plans(n):
        found = {(forward_plan(n, vocab, width, gather, itemsize, b, align, piece=piece)[0], vocab)
                 for gather in (True, False) for b in budgets}
        for gather in (True, False):
            plan = one_pass_plan(n, vocab, width, gather, itemsize, one_pass_budget, align, piece)
            if plan is not None:
                found.add((plan[0], vocab))
        return found

    return tuning_shapes(range(1, max_rows + 1), plans, vocab)
