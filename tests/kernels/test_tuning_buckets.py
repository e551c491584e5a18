"""Which tuning keys and micro-batch sizes a run can reach (``redline.kernels.tuning_buckets``), checked against
brute force over every row count."""

import pytest

from redline.kernels.lm_head_plan import backward_plan, forward_plan, one_pass_plan
from redline.kernels.tuning_buckets import (bucket, chunk_blocks, dz_tuning_shapes, int_class, prefill_shapes,
                                            row_buckets, stats_tuning_shapes, warmup_row_counts)


def test_bucket_is_the_power_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 1000, 1024, 1025, 16384)] == [1, 2, 4, 4, 8, 1024, 1024, 2048, 16384]
    with pytest.raises(ValueError, match="at least 1"):
        bucket(0)


def test_int_class_follows_tritons_integer_specialization():
    assert [int_class(n) for n in (1, 2, 15, 16, 32, 33, 8192)] == ["1", "other", "other", "16k", "16k", "other",
                                                                      "16k"]


def test_row_buckets_cover_every_count_up_to_the_budget():
    assert row_buckets(1) == [1]
    assert row_buckets(8192) == [2 ** k for k in range(14)]
    assert row_buckets(5000) == [2 ** k for k in range(14)]  # 5000 lies in the 8192 bucket


@pytest.mark.parametrize("max_rows", [1, 2, 3, 17, 100, 4097, 5000, 8192])
def test_warmup_row_counts_meet_every_bucket_in_every_integer_class(max_rows):
    counts = warmup_row_counts(max_rows)
    assert counts == sorted(set(counts)) and 1 <= counts[0] and counts[-1] == max_rows
    met = {(bucket(c), int_class(c)) for c in counts}
    needed = {(bucket(n), int_class(n)) for n in range(1, max_rows + 1)}
    assert met == needed


def test_warmup_row_counts_for_the_1p7b_example_budget():
    assert warmup_row_counts(8192) == [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 47, 63, 64, 111, 127, 128, 239, 255, 256,
                                       495, 511, 512, 1007, 1023, 1024, 2031, 2047, 2048, 4079, 4095, 4096, 8175,
                                       8191, 8192]
    with pytest.raises(ValueError, match="max_tokens_per_gpu"):
        warmup_row_counts(0)


def test_warmup_row_counts_meet_row_block_counts_off_multiples_of_16():
    """Kernels that handle rows in blocks of 2, 4, 8, 16 (RMSNorm: 4096 elements per program) see ceil(T / k): each
    bucket from 256 holds a count for which none of those is a multiple of 16, as its largest count does for all."""
    counts = warmup_row_counts(8192)
    for b in row_buckets(8192)[8:]:
        in_bucket = [n for n in counts if b // 2 < n <= b]
        for k in (1, 2, 4, 8, 16):
            assert {int_class(-(-n // k)) for n in in_bucket} >= {"16k", "other"}, (b, k)
        assert any(all(int_class(-(-n // k)) == "other" for k in (1, 2, 4, 8, 16)) for n in in_bucket), b


@pytest.mark.parametrize("max_prompts", [1, 2, 3, 8, 16, 17, 40])
@pytest.mark.parametrize("max_width", [1, 2, 5, 15, 16, 17, 18, 40])
def test_prefill_shapes_meet_every_class_pair_an_engine_batch_reaches(max_prompts, max_width):
    """Against brute force over every batch: each (rows, group) class pair of the RMSNorm over ``[prompts, width,
    H]`` that some batch within the limits reaches, met by a batch within them, one batch per pair."""
    shapes = prefill_shapes(max_prompts, max_width)
    assert shapes == sorted(set(shapes))
    assert all(1 <= p <= max_prompts and 1 <= w <= max_width for p, w in shapes)
    met = [(int_class(p * w), int_class(w)) for p, w in shapes]
    needed = {(int_class(p * w), int_class(w)) for p in range(1, max_prompts + 1) for w in range(1, max_width + 1)}
    assert len(met) == len(set(met)) and set(met) == needed


def test_prefill_shapes_for_the_1p7b_example_engine():
    """128 rows, prompts of at most 16 tokens: the decode step's (16k, 1) among them, which a trainer micro-batch
    (rows = group = T) never reaches."""
    assert prefill_shapes(128, 16) == [(1, 1), (1, 2), (1, 16), (2, 1), (8, 2), (16, 1)]
    with pytest.raises(ValueError, match="at least one prompt"):
        prefill_shapes(0, 16)


def test_chunk_blocks_are_full_chunks_and_tails():
    assert chunk_blocks(10, 4, 10, 4) == {(4, 4), (4, 2), (2, 4), (2, 2)}
    assert chunk_blocks(8, 4, 12, 4) == {(4, 4)}
    assert chunk_blocks(3, 4, 12, 12) == {(3, 12)}  # a chunk never holds more rows than the call has


def _brute_force(row_counts, plans, vocab):
    """(key, class pair) of every block any row count reaches."""
    found = set()
    for n in row_counts:
        for tc, vc in plans(n):
            tc = min(tc, n)
            for t0 in range(0, n, tc):
                for v0 in range(0, vocab, vc):
                    r, c = min(tc, n - t0), min(vc, vocab - v0)
                    found.add(((bucket(r), bucket(c)), (int_class(r), int_class(c))))
    return found


def _reached(shapes):
    return {(key, (int_class(r), int_class(c))) for key, blocks in shapes.items() for r, c in blocks
            if (bucket(r), bucket(c)) == key}


def test_dz_tuning_shapes_cover_exactly_what_the_backward_reaches():
    vocab, width, itemsize, align, budgets = 1000, 64, 2, 16, (2 ** 18, 2 ** 20)
    shapes = dz_tuning_shapes(1, 700, vocab, width, itemsize, budgets, align)

    def plans(n):
        return {backward_plan(n, vocab, width, g, itemsize, b, align, keeps_logits=False)
                for g in (True, False) for b in budgets}

    assert _reached(shapes) == _brute_force(range(1, 701), plans, vocab)
    assert sum(map(len, shapes.values())) == len(_reached(shapes))  # one block shape per class pair


def test_dz_tuning_shapes_start_at_the_smallest_row_count_that_uses_the_kernel():
    vocab, width, align, budgets = 1000, 64, 16, (2 ** 20,)
    shapes = dz_tuning_shapes(600, 700, vocab, width, 2, budgets, align)
    plans = lambda n: {backward_plan(n, vocab, width, g, 2, budgets[0], align, keeps_logits=False)  # noqa: E731
                       for g in (True, False)}
    assert _reached(shapes) == _brute_force(range(600, 701), plans, vocab)
    assert dz_tuning_shapes(800, 700, vocab, width, 2, budgets, align) == {}


def test_stats_tuning_shapes_take_the_whole_vocabulary_per_block():
    vocab, width, itemsize, align, piece = 1000, 64, 2, 16, 16
    budgets, one_pass = (2 ** 18, 2 ** 20), 2 ** 20
    shapes = stats_tuning_shapes(300, vocab, width, itemsize, budgets, one_pass, align, piece)

    def plans(n):
        found = {(forward_plan(n, vocab, width, g, itemsize, b, align, piece=piece)[0], vocab)
                 for g in (True, False) for b in budgets}
        return found | {(one_pass_plan(n, vocab, width, g, itemsize, one_pass, align, piece)[0], vocab)
                        for g in (True, False)}

    assert _reached(shapes) == _brute_force(range(1, 301), plans, vocab)
    assert {key[1] for key in shapes} == {bucket(vocab)}


def test_lm_head_keys_at_the_1p7b_shape_are_few():
    """Qwen3-1.7B's head (H=2048, V=151936, bf16) at the GPU's alignment and workspaces: the dz GEMM's keys for
    up to 32768 rows stay a few dozen (logarithmic in the token chunk), so all of them are tuned at start-up."""
    shapes = dz_tuning_shapes(16384, 32768, 151936, 2048, 2, (256 * 2 ** 20, 2 ** 30), 256)
    assert 16 <= len(shapes) <= 64
    assert {key[0] for key in shapes} == set(row_buckets(32768))  # every row bucket: token-chunk tails


@pytest.mark.parametrize("choice, capability, max_rows, kernels", [
    ("auto", (9, 0), 8192, set()),  # the 1.7B example's budget: cuBLAS below AUTO_DZ_MIN_ROWS, nothing to tune
    ("auto", (9, 0), 32768, {"gemm_dz"}),
    ("auto", (10, 0), 32768, set()),  # auto takes the Triton GEMM only where it was measured
    ("auto", None, 32768, set()),
    ("triton", (9, 0), 300, {"gemm_dz", "gemm_stats"}),
    ("triton-dz", (9, 0), 300, {"gemm_dz"}),
    ("triton", (8, 0), 300, set()),  # no TMA
    ("cublas", (9, 0), 32768, set())])
def test_reachable_kernels_follow_the_lm_head_gemm_choice(monkeypatch, choice, capability, max_rows, kernels):
    import torch

    from redline.kernels import lm_head_tuning

    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", choice)
    found = lm_head_tuning.reachable(max_rows, 1000, 64, torch.bfloat16, capability)
    assert set(found) == kernels
    if "gemm_dz" in found and choice == "auto":  # only calls of at least AUTO_DZ_MIN_ROWS selected rows run it
        from redline.kernels.linear_logprobs_triton import ALIGN, AUTO_DZ_MIN_ROWS

        assert found["gemm_dz"] == dz_tuning_shapes(AUTO_DZ_MIN_ROWS, max_rows, 1000, 64, 2, lm_head_tuning.BUDGETS,
                                                     ALIGN)
        assert found["gemm_dz"] != dz_tuning_shapes(1, max_rows, 1000, 64, 2, lm_head_tuning.BUDGETS, ALIGN)


def test_reachable_is_empty_for_rows_tma_cannot_load(monkeypatch):
    import torch

    from redline.kernels import lm_head_tuning

    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "triton")
    assert lm_head_tuning.reachable(300, 1000, 20, torch.bfloat16, (9, 0)) == {}  # 40-byte rows
