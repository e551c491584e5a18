"""GSPO through the one-pass path: token chunks of whole sequences (``lm_head_plan.token_chunk_bounds``).

A batch of nine sequences of unequal lengths (one empty, one whose tokens are all masked out) and a workspace of
about eight tokens' logits, so each chunk holds several sequences and its boundaries are not those of fixed
chunks. Loss, metrics, dHidden and dW must equal the two-pass path's and the fp64 reference's for every
aggregation, with and without a mask that deselects tokens, at temperature 0.8; a sequence longer than any token
chunk falls back to two passes (or raises when one pass is forced). The cost model's side is at the end.
"""

import itertools
import math

import pytest
import torch

from redline.kernels import LossConfig, linear_policy_loss, lm_head_plan
from redline.kernels.loss_config import AGG_MODES, KL_TYPES, TIS_MODES
from redline.kernels.reference import linear_logprobs_reference, linear_policy_loss_reference
from tests.kernels.policy_inputs import TEMPERATURE
from tests.kernels.policy_inputs import run as run_policy_loss

T, H, V = 40, 16, 141
CU_SEQLENS = torch.tensor([0, 3, 8, 8, 14, 15, 22, 26, 33, 40], dtype=torch.int32)
WORKSPACE = 7000  # bytes: 8 tokens' logits a chunk (CPU and interpreter alike), the longest sequence 7 tokens
TOO_SMALL = 4500  # bytes: 5 tokens a chunk on the CPU path, fewer than the longest masked sequence has


def make_inputs(masked: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(T, H, generator=gen), torch.randn(V, H, generator=gen)
    targets = torch.randint(0, V, (T,), generator=gen)
    mask = torch.rand(T, generator=gen) > 0.25 if masked else torch.ones(T, dtype=torch.bool)
    if masked:
        mask[26:33] = False  # a sequence with no selected token
    logp = linear_logprobs_reference(hidden.double(), weight.double(), targets, temperature=TEMPERATURE).float()
    # old/ref/rollout log-probs near the current ones: sequence ratios fall on both sides of the clip bounds
    near = [logp + 0.3 * torch.randn(T, generator=gen) for _ in range(3)]
    return dict(hidden=hidden, weight=weight, targets=targets, mask=mask, advantages=torch.randn(T, generator=gen),
                old_logp=near[0], ref_logp=near[1], rollout_logp=near[2])


def make_config(agg: str, i: int) -> LossConfig:
    """gspo with ``agg``; KL type, TIS mode and dual clip rotate with ``i``."""
    return LossConfig(estimator="gspo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0 if i % 2 else None,
                      kl_type=KL_TYPES[i % 4], kl_coef=0.05, entropy_coef=0.01, tis=TIS_MODES[i % 3],
                      tis_clip_low=0.5, tis_clip=2.0, agg=agg,
                      agg_constant=16.0 if agg == "seq-mean-token-sum-norm" else None)


def run(inputs, cfg, cu_seqlens=CU_SEQLENS, **options):
    """``policy_inputs.run`` over this module's nine sequences."""
    return run_policy_loss(inputs, cfg, cu_seqlens, **options)


def recorded_chunks(monkeypatch) -> list:
    """The chunk boundaries each call of the one-pass backend (REDLINE_KERNELS_BACKEND's) gets, as calls run."""
    module = linear_policy_loss._one_pass_backend(torch.device("cpu"))
    calls, one_pass = [], module.one_pass
    monkeypatch.setattr(module, "one_pass", lambda *args: calls.append(list(args[6])) or one_pass(*args))
    return calls


def assert_results_match(got, want, loss_tol):
    for a, b, name in [(got[0], want[0], "loss")] + [(got[1][k], v, k) for k, v in want[1].items()]:
        assert abs(a.item() - b.item()) <= loss_tol * max(1.0, abs(b.item())), name
    torch.testing.assert_close(got[2].double(), want[2].double(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[3].double(), want[3].double(), rtol=1e-4, atol=1e-6)


def assert_matches_two_passes_and_reference(inputs, cfg, monkeypatch, backend):
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", backend)
    chunks = recorded_chunks(monkeypatch)
    one = run(inputs, cfg, one_pass=True, workspace_bytes=WORKSPACE)
    assert len(chunks) == 1 and len(chunks[0]) > 2  # the one-pass path ran, over several chunks
    assert_results_match(one, run(inputs, cfg, one_pass=False, workspace_bytes=WORKSPACE), 1e-6)
    hidden64 = inputs["hidden"].double().requires_grad_()
    weight64 = inputs["weight"].double().requires_grad_()
    ref_loss, ref_metrics = linear_policy_loss_reference(
        hidden64, weight64, inputs["targets"], inputs["old_logp"], inputs["advantages"], inputs["mask"], cfg=cfg,
        temperature=TEMPERATURE, ref_logp=inputs["ref_logp"], rollout_logp=inputs["rollout_logp"],
        cu_seqlens=CU_SEQLENS)
    (2.5 * ref_loss).backward()
    assert_results_match(one, (ref_loss, ref_metrics, hidden64.grad, weight64.grad), 1e-5)  # fp32 vs fp64


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("masked", [True, False], ids=["masked", "all-selected"])
def test_chunks_hold_whole_sequences_not_fixed_token_counts(monkeypatch, backend, masked):
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", backend)
    inputs = make_inputs(masked)
    chunks = recorded_chunks(monkeypatch)
    run(inputs, make_config("token-mean", 0), one_pass=True, workspace_bytes=WORKSPACE)
    (bounds,) = chunks
    mask, rows = inputs["mask"], int(inputs["mask"].sum())
    seq_bounds = [int(mask[:b].sum()) for b in CU_SEQLENS.tolist()]  # the sequences among the selected rows
    align = linear_policy_loss.backend_for(torch.device("cpu")).ALIGN
    token_chunk, _ = lm_head_plan.one_pass_plan(rows, V, H, masked, 4, WORKSPACE, align, None, seq_bounds)
    assert bounds[0] == 0 and bounds[-1] == rows and set(bounds) <= set(seq_bounds)
    assert max(b - a for a, b in itertools.pairwise(bounds)) <= token_chunk
    assert len(bounds) >= 5 and bounds != lm_head_plan.token_chunk_bounds(rows, token_chunk)  # not fixed chunks
    sequences_per_chunk = [sum(1 for s, e in itertools.pairwise(seq_bounds) if a <= s < e <= b)
                           for a, b in itertools.pairwise(bounds)]
    assert max(sequences_per_chunk) >= 2


CASES = [(agg, masked) for agg in AGG_MODES for masked in (True, False)]


@pytest.mark.parametrize("agg,masked", CASES)
def test_cpu_gspo_one_pass_matches_two_passes_and_fp64_reference(monkeypatch, agg, masked):
    cfg = make_config(agg, AGG_MODES.index(agg) + masked)
    assert_matches_two_passes_and_reference(make_inputs(masked, seed=1), cfg, monkeypatch, "torch")


@pytest.mark.parametrize("agg,masked", CASES[::2] + [CASES[3]])
def test_triton_gspo_one_pass_matches_two_passes_and_fp64_reference(monkeypatch, agg, masked):
    cfg = make_config(agg, AGG_MODES.index(agg) + masked)
    assert_matches_two_passes_and_reference(make_inputs(masked, seed=2), cfg, monkeypatch, "triton")


@pytest.mark.parametrize("agg,masked", [("seq-mean-token-mean", True), ("token-mean", False)])
def test_fused_gemm_gspo_one_pass_matches_the_cublas_one_pass(monkeypatch, agg, masked):
    """REDLINE_LM_HEAD_GEMM=triton (statistics from the GEMM, logits kept as offsets: more bytes a token at fp32,
    so a larger workspace for the same sequence chunks); loss and metrics exact, gradients within the offsets'
    rounding (test_linear_policy_loss_one_pass.py's bounds)."""
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", "triton")
    inputs, cfg = make_inputs(masked, seed=2), make_config(agg, 1)
    chunks = recorded_chunks(monkeypatch)
    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "triton")
    fused = run(inputs, cfg, one_pass=True, workspace_bytes=9000)
    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "cublas")
    unfused = run(inputs, cfg, one_pass=True, workspace_bytes=9000)
    assert len(chunks) == 2 and len(chunks[0]) > 3  # one pass both times, several chunks
    for got, want, name in [(fused[0], unfused[0], "loss")] + [(fused[1][k], v, k) for k, v in unfused[1].items()]:
        assert abs(got.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item())), name
    for got, want in zip(fused[2:], unfused[2:]):
        assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_without_cu_seqlens_the_batch_is_one_sequence_in_one_chunk(monkeypatch):
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", "torch")
    inputs, cfg = make_inputs(True, seed=3), make_config("seq-mean-token-mean", 1)
    chunks = recorded_chunks(monkeypatch)
    one = run(inputs, cfg, cu_seqlens=None, one_pass=True)
    assert chunks == [[0, int(inputs["mask"].sum())]]
    assert_results_match(one, run(inputs, cfg, cu_seqlens=None, one_pass=False), 1e-6)


def test_sequence_longer_than_a_chunk_falls_back_to_two_passes_when_unforced(monkeypatch):
    monkeypatch.setenv("REDLINE_KERNELS_BACKEND", "torch")
    monkeypatch.setattr(lm_head_plan, "two_pass_seconds", lambda *shape: math.inf)  # one pass wherever it fits
    inputs, cfg = make_inputs(True, seed=4), make_config("seq-mean-token-sum", 2)
    chunks = recorded_chunks(monkeypatch)
    unforced = run(inputs, cfg, workspace_bytes=TOO_SMALL)
    assert chunks == []
    two = run(inputs, cfg, one_pass=False, workspace_bytes=TOO_SMALL)
    for a, b in zip(unforced[:1] + unforced[2:], two[:1] + two[2:]):
        assert torch.equal(a, b)
    # the same workspace takes ppo through one pass: what falls back is gspo's sequence, not the workspace
    run(inputs, LossConfig(estimator="ppo", eps_clip=0.2), workspace_bytes=TOO_SMALL)
    assert len(chunks) == 1


def test_sequence_longer_than_a_chunk_raises_when_one_pass_is_forced():
    inputs = make_inputs(True, seed=4)
    selected = [int(inputs["mask"][:b].sum()) for b in CU_SEQLENS.tolist()]
    longest = max(b - a for a, b in itertools.pairwise(selected))
    capacity = lm_head_plan.one_pass_token_capacity(selected[-1], V, H, True, 4, TOO_SMALL, 1)
    assert 0 < capacity < longest
    with pytest.raises(ValueError, match=f"'gspo' needs each sequence's selected tokens in one token chunk, but the "
                                         f"longest sequence has {longest} and a chunk holds at most {capacity} "
                                         f"within workspace_bytes={TOO_SMALL}"):
        run(inputs, make_config("token-mean", 0), one_pass=True, workspace_bytes=TOO_SMALL)


# ---------------------------------------------------------------- chunk boundaries and the cost model

def test_fixed_chunks_every_token_chunk_rows():
    assert lm_head_plan.token_chunk_bounds(10, 4) == [0, 4, 8, 10]
    assert lm_head_plan.token_chunk_bounds(0, 4) == [0]


def test_sequence_chunks_pack_whole_sequences_in_order():
    # sequences of 3, 0, 2, 4 and 1 rows; chunks of at most 5 rows
    assert lm_head_plan.token_chunk_bounds(10, 5, [0, 3, 3, 5, 9, 10]) == [0, 5, 10]
    assert lm_head_plan.token_chunk_bounds(10, 4, [0, 3, 3, 5, 9, 10]) == [0, 3, 5, 9, 10]
    assert lm_head_plan.token_chunk_bounds(10, 3, [0, 3, 3, 5, 9, 10]) is None  # the 4-row sequence


# H=4096, V=151936, T=16384 (bf16) on the H100 with the 1 GiB workspace, where token-level estimators are modelled
# (and measured) faster in one pass
H100 = (16384, 151936, 4096, True, 2, 2**30, 256)


def test_cost_model_charges_each_sequence_aligned_chunk():
    token_chunk, _ = lm_head_plan.one_pass_plan(*H100)
    aligned = lm_head_plan.token_chunk_bounds(16384, token_chunk)  # sequences as long as the chunks: no change
    assert lm_head_plan.one_pass_seconds(*H100, None, aligned) == pytest.approx(lm_head_plan.one_pass_seconds(*H100))
    # 1024-token sequences: one per chunk, 16 chunks where fixed ones of 1472 tokens are 12; each extra chunk costs
    # its fixed time and one more read-modify-write of the bf16 dW (the weight's reads stay hidden behind GEMMs of
    # 1024 tokens)
    short = list(range(0, 16384 + 1, 1024))
    fixed = lm_head_plan._one_pass_seconds(16384, 151936, 4096, 2, 1472, 32768)
    extra = 4 * (lm_head_plan.ONE_PASS_CHUNK_SECONDS + 2 * 151936 * 4096 * 2 / lm_head_plan.HBM_BYTES_PER_S)
    assert lm_head_plan._one_pass_seconds(16384, 151936, 4096, 2, 1472, 32768, None, short) == pytest.approx(
        fixed + extra)
    # the plan is the candidate rated fastest with those chunks
    assert lm_head_plan.one_pass_seconds(*H100, None, short) == min(
        lm_head_plan._one_pass_seconds(16384, 151936, 4096, 2, tc, vc, None, short)
        for tc, vc in lm_head_plan._one_pass_candidates(*H100, None))


def test_cost_model_rules_out_one_pass_for_a_sequence_longer_than_any_chunk():
    capacity = lm_head_plan.one_pass_token_capacity(*H100)
    assert lm_head_plan.choose_one_pass(*H100, None, list(range(0, 16384 + 1, 1024)))
    too_long = [0, capacity + 1] + list(range(2048, 16384 + 1, 1024))  # one sequence a token over the capacity
    assert math.isinf(lm_head_plan.one_pass_seconds(*H100, None, too_long))
    assert lm_head_plan.choose_one_pass(*H100) and not lm_head_plan.choose_one_pass(*H100, None, too_long)
