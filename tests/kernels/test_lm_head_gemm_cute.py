"""The CuTe-DSL LM-head GEMMs (``redline.kernels.lm_head_gemm_cute``, QuACK's sm_90 GEMMs with redline's epilogues).

On the CPU: the host glue around the two epilogues, fed with what each epilogue's contract says it writes
(``lm_head_cute_epilogues``' docstring), computed here in fp64 from the logits; merged, the statistics must give the
reference log-probs and entropy, and dz the gradient of ``g_lp·logp + g_H·entropy``. On an sm_90 GPU with QuACK
installed: the kernels themselves against the fp64 reference and against the cuBLAS path.
"""

import math

import pytest
import torch

from redline.kernels import fused_linear_logprobs
from redline.kernels.lm_head_gemm_cute import (LOG2E, STATS_BLOCK_N, dz_row_terms, fix_target_column,
                                               stats_into_parts, supported)
from redline.kernels.reference import linear_logprobs_reference
from redline.kernels.vocab_stats import RowStats, combine, finalize

T, H, V = 9, 16, 3 * STATS_BLOCK_N
TEMPERATURE = 0.7


def _logits(seed=0, t=T, v=V):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, H, generator=gen, dtype=torch.float64) * 0.8
    targets = torch.randint(0, v, (t,), generator=gen)
    return hidden, weight, targets


def _stats_epilogue(acc, target, inv_temp):
    """What the statistics epilogue writes for raw logits ``acc [t, V]``: per tile, max(acc)·log2(e), Σ 2^offset and
    Σ 2^offset·offset with offset = (acc·log2(e) − max)·inv_temp; the target's raw logit where it lies in [0, V)."""
    tiles = acc.view(acc.shape[0], -1, STATS_BLOCK_N)
    piece_max = tiles.amax(-1) * LOG2E
    offset = (tiles * LOG2E - piece_max[..., None]) * inv_temp
    e = torch.exp2(offset)
    inside = (target >= 0) & (target < acc.shape[1])
    garbage = torch.full((acc.shape[0],), float("nan"), dtype=torch.float64)
    target_logit = torch.where(inside, acc.gather(1, target.clamp(0, acc.shape[1] - 1)[:, None])[:, 0], garbage)
    return piece_max, e.sum(-1), (e * offset).sum(-1), target_logit


def _merged_stats(acc, target, inv_temp):
    piece_max, sum_exp, sum_exp_offset, target_logit = _stats_epilogue(acc, target, inv_temp)
    parts = torch.empty(5, acc.shape[0], acc.shape[1] // STATS_BLOCK_N, dtype=torch.float32)
    parts[0], parts[1], parts[2] = piece_max, sum_exp, sum_exp_offset
    stats_into_parts(parts, target, target_logit.float(), acc.shape[1], inv_temp)
    return parts


def test_statistics_glue_gives_the_reference_logprobs_and_entropy():
    hidden, weight, targets = _logits()
    parts = _merged_stats(hidden @ weight.t(), targets, 1 / TEMPERATURE)
    logp, entropy, _ = finalize(combine(RowStats(*parts)))
    ref_logp, ref_entropy = linear_logprobs_reference(hidden, weight, targets, temperature=TEMPERATURE,
                                                      return_entropy=True)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)


def test_statistics_glue_counts_a_target_outside_the_shard_as_a_miss():
    """A tensor-parallel shard sees other shards' targets as ids outside [0, V): no hit, zy 0, garbage ignored."""
    hidden, weight, targets = _logits(seed=1)
    targets[:3] = torch.tensor([-5, V, 10 * V])
    parts = _merged_stats(hidden @ weight.t(), targets, 1.0)
    stats = combine(RowStats(*parts))
    assert stats.hit.tolist() == [0.0] * 3 + [1.0] * (T - 3)
    assert stats.zy[:3].tolist() == [0.0] * 3
    assert torch.isfinite(stats.zy).all()


def _dz_epilogue(acc, target, row_values, inv_temp, col0):
    """What the dz epilogue writes for raw logits ``acc [t, vc]`` (columns col0…): p·(α + β·acc), p from lse, and
    the target's raw logit where it lies in the block."""
    lse_log2, alpha, beta = (x[0].double() for x in dz_row_terms(row_values, inv_temp))
    p = torch.exp2(acc * inv_temp * LOG2E - lse_log2[:, None])
    local = target - col0
    inside = (local >= 0) & (local < acc.shape[1])
    target_logit = torch.where(inside, acc.gather(1, local.clamp(0, acc.shape[1] - 1)[:, None])[:, 0],
                               torch.full_like(lse_log2, float("nan")))
    return (p * (alpha[:, None] + beta[:, None] * acc)).float(), target_logit.float()


@pytest.mark.parametrize("with_entropy", [True, False])
def test_dz_glue_gives_the_gradient_of_logprob_and_entropy(with_entropy):
    hidden, weight, targets = _logits(seed=2)
    acc = (hidden @ weight.t()).requires_grad_()
    logp_all = torch.log_softmax(acc / TEMPERATURE, -1)
    logp = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    gen = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(T, generator=gen, dtype=torch.float64), torch.randn(T, generator=gen, dtype=torch.float64)
    (g_lp * logp + (g_ent * entropy if with_entropy else 0)).sum().backward()
    lse = torch.logsumexp(acc.detach() / TEMPERATURE, -1)
    row_values = (lse.float(), entropy.detach().float(), g_lp.float(), g_ent.float() if with_entropy else None)
    dz = torch.empty(T, V, dtype=torch.float32)
    for col0 in range(0, V, 100):  # vocab chunks that do not line up with the tiles; the last one ragged
        block = acc.detach()[:, col0:col0 + 100]
        part, target_logit = _dz_epilogue(block, targets, row_values, 1 / TEMPERATURE, col0)
        fix_target_column(part, targets, col0, target_logit, row_values, 1 / TEMPERATURE)
        dz[:, col0:col0 + 100] = part
    torch.testing.assert_close(dz.double(), acc.grad, rtol=1e-4, atol=1e-6)


def test_dz_target_fix_writes_bf16_through_a_strided_view_and_leaves_other_rows_alone():
    dz = torch.zeros(4, 16, dtype=torch.bfloat16)[:, :10]  # row stride padded as the GEMM's TMA stores want
    target = torch.tensor([3, 12, 0, 9])
    row = torch.tensor([0.0, 0.0, 0.0, 0.0])
    values = (row, row, torch.ones(4), None)  # lse 0, g_lp 1: dz_target = (1 − exp(z))/τ
    logits = torch.tensor([math.log(0.25), 5.0, 1.0, math.log(0.5)]) / 2.0  # p = 0.25, -, -, 0.5 at τ = 1/2
    fix_target_column(dz, target, 2, logits, values, 2.0)
    expected = torch.zeros(4, 10)
    expected[0, 1], expected[3, 7] = 1.5, 1.0  # rows 1, 2: targets outside columns 2…11
    assert torch.equal(dz.float(), expected)


def test_cpu_tensors_are_refused_with_the_reason():
    assert supported(torch.zeros(2, 8)) == "the CuTe-DSL GEMMs need CUDA tensors"


def _needs_quack():
    try:
        import quack.epilogue.frontend  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"QuACK's CuTe-DSL GEMMs are not installed ({exc}); pip install 'redline[gpu]'")


def _gpu_inputs(t, h, v, seed, device):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    weight = (torch.randn(v, h, generator=gen) * h ** -0.5).to(torch.bfloat16).to(device)
    targets = torch.randint(0, v, (t,), generator=gen).to(device)
    mask = (torch.rand(t, generator=gen) > 0.3).to(device)
    return hidden, weight, targets, mask


@pytest.mark.gpu
def test_gpu_cute_statistics_match_fp64_at_a_qwen3_shape(cuda, monkeypatch):
    _needs_quack()
    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "cute")
    hidden, weight, targets, mask = _gpu_inputs(2000, 4096, 151936, 11, cuda)
    logp, entropy = fused_linear_logprobs(hidden, weight, targets, temperature=TEMPERATURE, mask=mask,
                                          return_entropy=True)
    for i in range(0, 2000, 500):
        ref = linear_logprobs_reference(hidden[i:i + 500].double(), weight.double(), targets[i:i + 500],
                                        temperature=TEMPERATURE, mask=mask[i:i + 500], return_entropy=True)
        for actual, expected in zip((logp[i:i + 500], entropy[i:i + 500]), ref):
            error = (actual.double() - expected).abs()
            assert error.max() <= 1e-4 and error.mean() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["cute", "cute-dz"])
def test_gpu_cute_gradients_match_the_cublas_path_and_fp64(cuda, monkeypatch, gemm):
    _needs_quack()
    hidden, weight, targets, mask = _gpu_inputs(1000, 1024, 32000, 12, cuda)
    g = torch.randn(2, 1000, device=cuda)
    grads = {}
    for choice in (gemm, "cublas"):
        monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", choice)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = fused_linear_logprobs(h, w, targets, temperature=TEMPERATURE, mask=mask, return_entropy=True)
        (g[0] * logp + g[1] * entropy).sum().backward()
        grads[choice] = (h.grad, w.grad)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp, entropy = linear_logprobs_reference(h64, w64, targets, temperature=TEMPERATURE, mask=mask,
                                              return_entropy=True)
    (g[0].double() * logp + g[1].double() * entropy).sum().backward()
    for actual, cublas, expected in zip(grads[gemm], grads["cublas"], (h64.grad, w64.grad)):
        ours = ((actual.double() - expected).norm() / expected.norm()).item()
        theirs = ((cublas.double() - expected).norm() / expected.norm()).item()
        assert ours < 1e-2 and ours <= 1.5 * theirs


@pytest.mark.gpu
def test_gpu_one_pass_policy_loss_with_cute_statistics_matches_cublas(cuda, monkeypatch):
    """The one-pass loss keeps each logit as an fp16 offset from its tile's max, written by the statistics GEMM."""
    _needs_quack()
    from redline.kernels import LossConfig, fused_linear_policy_loss

    hidden, weight, targets, mask = _gpu_inputs(1024, 1024, 32000, 13, cuda)
    gen = torch.Generator(device=cuda).manual_seed(1)
    old_logp = -torch.rand(1024, device=cuda, generator=gen) * 8
    advantages = torch.randn(1024, device=cuda, generator=gen)
    cfg = LossConfig(estimator="ppo", eps_clip=0.2, kl_type="k3", kl_coef=0.04, entropy_coef=0.01, agg="token-mean")
    results = {}
    for choice in ("cute", "cublas"):
        monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", choice)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, metrics = fused_linear_policy_loss(h, w, targets, old_logp, advantages, mask, cfg=cfg,
                                                 temperature=TEMPERATURE, ref_logp=old_logp, one_pass=True)
        loss.backward()
        results[choice] = (loss.detach(), metrics["entropy"], h.grad, w.grad)
    for ours, theirs in zip(results["cute"][:2], results["cublas"][:2]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(results["cute"][2:], results["cublas"][2:]):
        assert ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item() < 1e-2


@pytest.mark.gpu
def test_gpu_a_vocabulary_off_the_tile_is_refused_naming_it(cuda, monkeypatch):
    _needs_quack()
    monkeypatch.setenv("REDLINE_LM_HEAD_GEMM", "cute")
    hidden, weight, targets, _ = _gpu_inputs(64, 256, 32003, 14, cuda)
    with pytest.raises(ValueError, match="REDLINE_LM_HEAD_GEMM=cute: a vocabulary .shard. of 32003 is not a multiple"):
        fused_linear_logprobs(hidden, weight, targets)


@pytest.fixture
def quack_installed(monkeypatch):
    """As if QuACK imported (``why_not`` is pure arithmetic otherwise): the decisions below need no GPU."""
    from redline.kernels import lm_head_gemm_cute

    monkeypatch.setattr(lm_head_gemm_cute, "quack_missing", lambda: None)


@pytest.mark.parametrize("kernel, capability, dtype, vocab, chosen", [
    ("stats", (9, 0), torch.bfloat16, 151936, "cute"), ("dz", (9, 0), torch.bfloat16, 151936, "cute"),
    ("stats", (9, 0), torch.bfloat16, 32003, None), ("dz", (9, 0), torch.bfloat16, 32003, "cute"),
    ("stats", (9, 0), torch.float32, 151936, None), ("dz", (9, 0), torch.float32, 151936, "triton-dz"),
    ("dz", (10, 0), torch.bfloat16, 151936, None), ("stats", None, torch.bfloat16, 151936, None)])
def test_auto_takes_the_cute_gemms_wherever_they_can_run(quack_installed, kernel, capability, dtype, vocab, chosen):
    """sm_90, bf16/fp16, a vocabulary on the statistics tile: QuACK's GEMMs; otherwise the choice made before them
    (the Triton dz GEMM on Hopper from AUTO_DZ_MIN_ROWS rows). sm_100 has configurations (``cute`` runs them) but
    no measurement, so ``auto`` leaves it alone."""
    from redline.kernels.lm_head_gemm_cute import why_not

    assert why_not((10, 0), torch.bfloat16, 4096, 151936) is None
    from redline.kernels.linear_logprobs_triton import AUTO_DZ_MIN_ROWS, auto_gemm

    assert auto_gemm(kernel, capability, dtype, 4096, vocab, AUTO_DZ_MIN_ROWS, None) == chosen


def test_auto_without_quack_keeps_the_triton_choice(monkeypatch):
    from redline.kernels import lm_head_gemm_cute
    from redline.kernels.linear_logprobs_triton import AUTO_DZ_MIN_ROWS, auto_gemm

    monkeypatch.setattr(lm_head_gemm_cute, "quack_missing", lambda: "QuACK is not importable (test)")
    assert auto_gemm("stats", (9, 0), torch.bfloat16, 4096, 151936, AUTO_DZ_MIN_ROWS, None) is None
    assert auto_gemm("dz", (9, 0), torch.bfloat16, 4096, 151936, AUTO_DZ_MIN_ROWS, None) == "triton-dz"
    assert auto_gemm("dz", (9, 0), torch.bfloat16, 4096, 151936, AUTO_DZ_MIN_ROWS - 1, None) is None


def test_warm_up_covers_both_cute_kernels_from_one_row_under_auto(quack_installed, monkeypatch):
    """The loop's warm-up (``lm_head_tuning``) compiles what ``auto`` will run: with QuACK, both kernels at every
    row count (the Triton dz GEMM alone started at AUTO_DZ_MIN_ROWS)."""
    from redline.kernels import lm_head_tuning

    monkeypatch.delenv("REDLINE_LM_HEAD_GEMM", raising=False)
    found = lm_head_tuning.reachable(1000, 151936, 4096, torch.bfloat16, (9, 0))
    assert set(found) == {"gemm_dz", "gemm_stats"}
    assert min(rows for rows, _ in found["gemm_dz"]) == 1 == min(rows for rows, _ in found["gemm_stats"])
    assert lm_head_tuning.reachable(1000, 32003, 4096, torch.bfloat16, (9, 0)).keys() == {"gemm_dz"}


def test_supported_names_what_is_missing():
    from redline.kernels.lm_head_gemm_cute import why_not

    assert "8.0 has no launch configuration" in why_not((8, 0), torch.bfloat16, 4096)
    assert "take bf16 or fp16" in why_not((9, 0), torch.float32, 4096)
    assert "multiple of 16 (TMA)" in why_not((9, 0), torch.bfloat16, 4100)
    assert "32003 is not a multiple of 128" in why_not((9, 0), torch.bfloat16, 4096, 32003)
