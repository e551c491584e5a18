"""redline.kernels.policy_loss against the fp64 reference.

On a machine without a GPU the Triton kernel runs on CPU tensors under TRITON_INTERPRET=1 (set by the root
conftest), the PyTorch path runs as it does in CPU training; tests marked ``gpu`` repeat the comparison with
the compiled kernel at 1M tokens.
"""

import itertools

import pytest
import torch

from redline.kernels.loss_config import AGG_MODES, ESTIMATORS, KL_TYPES, TIS_MODES, LossConfig
from redline.kernels.backend import BACKEND_ENV
from redline.kernels.policy_loss import policy_loss, policy_loss_grads
from redline.kernels.policy_loss_torch import policy_loss_grads_torch
from redline.kernels.policy_loss_triton import policy_loss_grads_triton
from redline.kernels.reference import METRIC_NAMES, policy_loss_reference

IMPLEMENTATIONS = {"triton": policy_loss_grads_triton, "torch": policy_loss_grads_torch}
# lengths 7, 0 (empty), 12, 4 (every token masked out), 8; each sequence's log-ratios are centred on a shift
# chosen so that gspo's sequence ratios land above the dual clip, below 1 - eps, and inside the range
SMALL = dict(lengths=[7, 0, 12, 4, 8], shifts=[1.3, 0.0, -0.6, 0.0, 0.1], masked_out=[3])


def make_batch(lengths, shifts, *, masked_out=(), seed=0, device="cpu"):
    """Per-token inputs of a packed batch (a dict of policy_loss keyword arguments, fp32); the sequences
    numbered in ``masked_out`` have every token masked out."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    logp = -3 * torch.rand(num_tokens, generator=gen)
    old_logp = logp - torch.tensor(shifts)[seq] - 0.5 * torch.randn(num_tokens, generator=gen)
    ref_logp = logp + 0.7 * torch.randn(num_tokens, generator=gen)
    ref_logp[1] = logp[1] + 4.0  # delta = -4: k3 = e^4 - 5 > 10, so low_var_kl's clamp is active
    mask = (torch.rand(num_tokens, generator=gen) > 0.25) & ~torch.isin(seq, torch.tensor(masked_out, dtype=torch.long))
    cu_seqlens = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    batch = dict(logp=logp, old_logp=old_logp, advantages=torch.randn(num_tokens, generator=gen), mask=mask,
                 ref_logp=ref_logp, rollout_logp=old_logp + 0.6 * torch.randn(num_tokens, generator=gen),
                 entropy=2 * torch.rand(num_tokens, generator=gen), cu_seqlens=cu_seqlens)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def make_config(estimator, kl_type, tis, agg, **overrides):
    settings = dict(estimator=estimator, eps_clip=0.2, eps_clip_high=0.28, kl_type=kl_type, kl_coef=0.05,
                    entropy_coef=0.01, tis=tis, tis_clip_low=0.5, tis_clip=2.0, agg=agg,
                    agg_constant=16.0 if agg == "seq-mean-token-sum-norm" else None,
                    eps_clip_c=None if estimator == "cispo" else 3.0)
    settings.update(overrides)
    return LossConfig(**settings)


def reference(batch, cfg):
    """(loss, metrics [7], dloss_dlogp, dloss_dentropy) of the fp64 reference, gradients by autograd."""
    wide = {name: t.double() if t.is_floating_point() else t for name, t in batch.items()}
    wide["logp"].requires_grad_()
    wide["entropy"].requires_grad_()
    loss, metrics = policy_loss_reference(**wide, cfg=cfg)
    dlogp, dentropy = torch.autograd.grad(loss, [wide["logp"], wide["entropy"]])
    return loss.detach(), torch.stack([metrics[name] for name in METRIC_NAMES]), dlogp, dentropy


def assert_matches(actual, expected, skip_tokens=None, loss_scale=None):
    """fp32 results against fp64: each tensor within 2e-5 of its own largest magnitude (so tiny per-token
    gradients, ~1/T, are compared at their own scale) plus a 1e-4 relative tolerance. ``skip_tokens`` [T] bool
    leaves those tokens out of the gradient comparison. ``loss_scale``: the summed magnitude of the loss's
    per-token terms; a loss whose terms nearly cancel is compared at that scale (fp32 summation error is
    relative to the terms, not to their near-zero sum)."""
    for name, got, want in zip(("loss", "metrics", "dloss_dlogp", "dloss_dentropy"), actual, expected):
        assert got.dtype == torch.float32, name
        want = want.to(got.device, torch.float32)
        if skip_tokens is not None and name == "dloss_dlogp":
            got, want = got[~skip_tokens], want[~skip_tokens]
        scale = max(want.abs().max().item(), 1e-6)
        if name == "loss" and loss_scale is not None:
            scale = max(scale, loss_scale)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * scale, msg=name)


def on_a_switch(batch, cfg, rel=1e-6):
    """[T] bool: tokens whose gradient jumps within ``rel`` of where they sit (a clip bound, icepop's bounds,
    low_var_kl's clamp), so fp32 rounding may legitimately put them on the other side than fp64 does. At 1M
    tokens a few hundred thousandths of a percent land there; on small batches none do."""
    wide = {name: t.double() if t.is_floating_point() else t for name, t in batch.items()}
    mask = wide["mask"]
    ratio = torch.exp(wide["logp"] - wide["old_logp"])
    if cfg.estimator == "gspo":
        seq = torch.repeat_interleave(torch.arange(len(wide["cu_seqlens"]) - 1, device=mask.device),
                                      torch.diff(wide["cu_seqlens"]).long(), output_size=mask.numel())
        log_ratio = torch.where(mask, wide["logp"] - wide["old_logp"], 0)
        count = torch.zeros(seq.max() + 1, dtype=torch.float64, device=mask.device).index_add(0, seq, mask.double())
        ratio = torch.exp(torch.zeros_like(count).index_add(0, seq, log_ratio) / count.clamp(min=1))[seq]

    def near(values, bound):
        return ((values / bound - 1).abs() < rel) & mask

    hits = near(ratio, 1 - cfg.eps_clip) | near(ratio, 1 + cfg.eps_clip_high)
    if cfg.eps_clip_c is not None:
        hits |= near(ratio, cfg.eps_clip_c)
    if cfg.tis == "icepop":
        weight = torch.exp(wide["old_logp"] - wide["rollout_logp"])
        hits |= near(weight, cfg.tis_clip_low) | near(weight, cfg.tis_clip)
    if cfg.kl_type == "low_var_kl":
        delta = wide["logp"] - wide["ref_logp"]
        hits |= near(torch.expm1(-delta) + delta, 10.0)
    return hits


CONFIGS = list(itertools.product(ESTIMATORS, KL_TYPES, TIS_MODES, AGG_MODES))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("estimator,kl_type,tis,agg", CONFIGS)
def test_matches_reference(impl, estimator, kl_type, tis, agg):
    batch = make_batch(**SMALL)
    cfg = make_config(estimator, kl_type, tis, agg)
    assert_matches(IMPLEMENTATIONS[impl](**batch, cfg=cfg), reference(batch, cfg))


@pytest.mark.parametrize("estimator,changed", [
    ("ppo", dict(eps_clip_c=None)), ("gspo", dict(eps_clip_c=None)),  # the dual clip is active somewhere
    ("ppo", dict(eps_clip_high=0.2)), ("gspo", dict(eps_clip_high=0.2)), ("cispo", dict(eps_clip_high=0.2)),
    ("ppo", dict(eps_clip=0.1)), ("gspo", dict(eps_clip=0.1)),  # tokens below 1 - eps_clip exist
    ("ppo", dict(tis="icepop")),  # weights outside [tis_clip_low, tis_clip] exist
    ("ppo", dict(kl_type="k3")),  # low_var_kl's clamp is active
])
def test_small_batch_reaches_the_branch(estimator, changed):
    """The batch of test_matches_reference exercises each clip: turning one off changes the loss or gradient."""
    batch = make_batch(**SMALL)
    base = make_config(estimator, "low_var_kl", "truncate", "token-mean")
    other = make_config(estimator, changed.get("kl_type", "low_var_kl"), changed.get("tis", "truncate"),
                        "token-mean", **{k: v for k, v in changed.items() if k not in ("kl_type", "tis")})
    (loss_a, _, grad_a, _), (loss_b, _, grad_b, _) = reference(batch, base), reference(batch, other)
    assert not torch.allclose(loss_a, loss_b) or not torch.allclose(grad_a, grad_b)


@pytest.mark.parametrize("block", [2, 4])
@pytest.mark.parametrize("estimator,agg", [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean"),
                                           ("cispo", "seq-mean-token-sum"), ("gspo", "seq-mean-token-sum-norm")])
def test_triton_sequences_spanning_several_programs_match_reference(estimator, agg, block):
    """Blocks of 2 or 4 tokens: sequences span several programs, programs hold several sequences."""
    batch = make_batch(**SMALL)
    cfg = make_config(estimator, "k3", "truncate", agg)
    assert_matches(policy_loss_grads_triton(**batch, cfg=cfg, block=block), reference(batch, cfg))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("estimator,agg", [("gspo", "seq-mean-token-mean"), ("ppo", "seq-mean-token-sum")])
def test_empty_sequences_at_both_ends_match_reference(impl, estimator, agg):
    batch = make_batch([0, 6, 0, 0, 9, 0], [0.0, 0.3, 0.0, 0.0, -0.2, 0.0])
    cfg = make_config(estimator, "k2", None, agg)
    options = dict(block=4) if impl == "triton" else {}
    assert_matches(IMPLEMENTATIONS[impl](**batch, cfg=cfg, **options), reference(batch, cfg))


def test_triton_sequence_over_more_slots_than_one_summing_step_matches_reference():
    from redline.kernels.policy_loss_triton import SLOT_RANGE

    batch = make_batch([5, 3 * SLOT_RANGE * 4 + 3, 6], [0.2, -0.1, 0.4])
    cfg = make_config("gspo", "k1", "icepop", "seq-mean-token-mean")
    assert_matches(policy_loss_grads_triton(**batch, cfg=cfg, block=4), reference(batch, cfg))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_long_single_sequence_is_spread_over_programs(impl):
    batch = make_batch([2500], [0.1])
    del batch["cu_seqlens"]
    cfg = make_config("gspo", "k2", "icepop", "seq-mean-token-mean")
    assert_matches(IMPLEMENTATIONS[impl](**batch, cfg=cfg), reference(batch, cfg))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_strided_inputs_give_the_same_result_as_contiguous_ones(impl):
    batch = make_batch(**SMALL)
    cfg = make_config("ppo", "k3", "truncate", "seq-mean-token-mean")
    strided = {name: torch.stack([t, t], dim=1)[:, 0] if name != "cu_seqlens" else t for name, t in batch.items()}
    assert not strided["logp"].is_contiguous()
    for got, want in zip(IMPLEMENTATIONS[impl](**strided, cfg=cfg), IMPLEMENTATIONS[impl](**batch, cfg=cfg)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_without_cu_seqlens_the_batch_is_one_sequence(impl):
    batch = make_batch([20], [0.3])
    cfg = make_config("gspo", "k1", None, "seq-mean-token-sum")
    packed = IMPLEMENTATIONS[impl](**batch, cfg=cfg)
    del batch["cu_seqlens"]
    for got, want in zip(IMPLEMENTATIONS[impl](**batch, cfg=cfg), packed):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_fully_masked_batch_gives_zeros_not_nan(impl, estimator):
    batch = make_batch(**SMALL)
    batch["mask"] = torch.zeros_like(batch["mask"])
    loss, metrics, dlogp, dentropy = IMPLEMENTATIONS[impl](**batch, cfg=make_config(estimator, "k3", "icepop",
                                                                                    "seq-mean-token-mean"))
    assert loss.item() == 0.0
    assert metrics.eq(0).all() and dlogp.eq(0).all() and dentropy.eq(0).all()


def test_policy_loss_backward_matches_reference_gradients():
    batch = make_batch(**SMALL)
    cfg = make_config("gspo", "low_var_kl", "truncate", "seq-mean-token-mean")
    logp = batch.pop("logp").requires_grad_()
    entropy = batch.pop("entropy").requires_grad_()
    loss, metrics = policy_loss(logp, **{k: batch[k] for k in ("old_logp", "advantages", "mask")}, cfg=cfg,
                                ref_logp=batch["ref_logp"], rollout_logp=batch["rollout_logp"], entropy=entropy,
                                cu_seqlens=batch["cu_seqlens"])
    (3 * loss).backward()
    expected = reference(dict(batch, logp=logp.detach(), entropy=entropy.detach()), cfg)
    assert_matches((loss, torch.stack([metrics[n] for n in METRIC_NAMES]), logp.grad / 3, entropy.grad / 3),
                   expected)


def test_backend_variable_runs_the_triton_kernel_behind_policy_loss(monkeypatch):
    batch = make_batch(**SMALL)
    cfg = make_config("gspo", "k3", "icepop", "seq-mean-token-sum")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    loss, metrics, dlogp, dentropy = policy_loss_grads(**batch, cfg=cfg)
    assert_matches((loss, torch.stack([metrics[n] for n in METRIC_NAMES]), dlogp, dentropy), reference(batch, cfg))


def test_unknown_backend_is_rejected_naming_the_variable(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        policy_loss(**make_batch(**SMALL), cfg=make_config("ppo", "k1", None, "token-mean"))


def test_metrics_are_fp32_scalars_that_do_not_require_grad():
    batch = make_batch(**SMALL)
    batch["logp"].requires_grad_()
    _, metrics = policy_loss(**batch, cfg=make_config("ppo", "k1", None, "token-mean"))
    assert list(metrics) == list(METRIC_NAMES)
    assert all(m.shape == () and m.dtype == torch.float32 and not m.requires_grad for m in metrics.values())


def test_policy_loss_grads_returns_the_gradients_backward_computes():
    batch = make_batch(**SMALL)
    cfg = make_config("cispo", "k2", "icepop", "seq-mean-token-sum-norm")
    _, _, dlogp, dentropy = policy_loss_grads(**batch, cfg=cfg)
    batch["logp"].requires_grad_()
    batch["entropy"].requires_grad_()
    loss, _ = policy_loss(**batch, cfg=cfg)
    loss.backward()
    torch.testing.assert_close(dlogp, batch["logp"].grad)
    torch.testing.assert_close(dentropy, batch["entropy"].grad)


def test_compiled_function_calling_policy_loss_matches_eager():
    batch = make_batch(**SMALL)
    cfg = make_config("ppo", "low_var_kl", "truncate", "seq-mean-token-mean")

    def step(logp, entropy):
        loss, metrics = policy_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"], cfg=cfg,
                                    ref_logp=batch["ref_logp"], rollout_logp=batch["rollout_logp"], entropy=entropy,
                                    cu_seqlens=batch["cu_seqlens"])
        return 2 * loss + metrics["kl"]

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        logp, entropy = batch["logp"].clone().requires_grad_(), batch["entropy"].clone().requires_grad_()
        out = fn(logp, entropy)
        out.backward()
        results.append((out.detach(), logp.grad, entropy.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


def _bad_inputs():
    batch = make_batch([3, 2], [0.0, 0.0])
    cases = [
        (dict(logp=batch["logp"].double()), "logp"),
        (dict(logp=batch["logp"][None]), "logp"),
        (dict(old_logp=batch["old_logp"][:4]), "old_logp"),
        (dict(advantages=batch["advantages"].double()), "advantages"),
        (dict(advantages=torch.zeros(2)), "advantages"),
        (dict(mask=batch["mask"].float()), "mask"),
        (dict(entropy=batch["entropy"][:2]), "entropy"),
        (dict(cu_seqlens=batch["cu_seqlens"].long()), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 4, 3, 5], dtype=torch.int32)), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0], dtype=torch.int32)), "cu_seqlens"),
        (dict(ref_logp=None), "ref_logp"),  # kl_coef > 0
        (dict(rollout_logp=None), "rollout_logp"),  # tis set
        (dict(entropy=None), "entropy"),  # entropy_coef != 0
        (dict(cfg=dict(kl_coef=0.05)), "cfg"),
    ]
    return batch, cases


@pytest.mark.parametrize("case", range(len(_bad_inputs()[1])))
def test_bad_input_raises_naming_the_argument(case):
    batch, cases = _bad_inputs()
    change, argument = cases[case]
    kwargs = dict(batch, cfg=make_config("ppo", "k1", "truncate", "token-mean"))
    kwargs.update(change)
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        policy_loss(**kwargs)


@pytest.mark.parametrize("block", [3, 0])
def test_triton_block_must_be_a_power_of_two(block):
    with pytest.raises(ValueError, match="^block must be a power of two"):
        policy_loss_grads_triton(**make_batch(**SMALL), cfg=make_config("ppo", "k1", None, "token-mean"), block=block)


def test_triton_path_rejects_more_tokens_than_int32_offsets_reach():
    huge = torch.empty(2**31, device="meta")  # shape only: the check runs before any allocation
    with pytest.raises(ValueError, match="^logp has 2147483648 tokens"):
        policy_loss_grads_triton(huge, huge, huge, huge.bool(), cfg=LossConfig())


# ---------------------------------------------------------------- GPU: the compiled kernel at 1M tokens

def gpu_batch(num_tokens=1 << 20, num_seqs=1024, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, num_tokens + 1, (num_seqs - 1,), generator=gen)).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([num_tokens])])).tolist()
    shifts = (2.3 * torch.rand(num_seqs, generator=gen) - 0.8).tolist()
    return make_batch(lengths, shifts, masked_out=range(0, num_seqs, 97), seed=seed, device="cuda")


@pytest.fixture(scope="module")
def big_batch():
    return gpu_batch()


@pytest.mark.gpu
@pytest.mark.parametrize("estimator,kl_type,tis,agg", CONFIGS)
def test_gpu_matches_reference_at_1m_tokens(big_batch, estimator, kl_type, tis, agg):
    cfg = make_config(estimator, kl_type, tis, agg)
    loss, metrics, dlogp, dentropy = policy_loss_grads(**big_batch, cfg=cfg)
    skip = on_a_switch(big_batch, cfg)
    assert skip.sum().item() < 100
    expected = reference(big_batch, cfg)
    # each token's loss term is at most |d loss/d logp| · (1 + |logp|) in size (cispo's is proportional to logp)
    terms = (expected[2].float().abs() * (1 + big_batch["logp"].abs().to(expected[2].device))).sum().item()
    assert_matches((loss, torch.stack([metrics[n] for n in METRIC_NAMES]), dlogp, dentropy), expected,
                   skip_tokens=skip, loss_scale=terms)


@pytest.mark.gpu
def test_gpu_results_are_bitwise_reproducible(big_batch):
    cfg = make_config("gspo", "low_var_kl", "truncate", "seq-mean-token-mean")
    first = policy_loss_grads_triton(**big_batch, cfg=cfg)
    second = policy_loss_grads_triton(**big_batch, cfg=cfg)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_call_is_graph_capturable_so_has_no_host_sync(big_batch):
    cfg = make_config("ppo", "k3", "icepop", "seq-mean-token-mean")
    eager = policy_loss_grads_triton(**big_batch, cfg=cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = policy_loss_grads_triton(**big_batch, cfg=cfg)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_forward_is_two_triton_launches_and_a_memset(big_batch):
    cfg = make_config("gspo", "k2", "truncate", "token-mean")
    policy_loss_grads_triton(**big_batch, cfg=cfg)  # compile outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        policy_loss_grads_triton(**big_batch, cfg=cfg)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("sequence_stats_kernel" in name or "token_loss_kernel" in name for name in kernels) == 2
    assert len(kernels) <= 3, kernels


@pytest.mark.gpu
def test_gpu_compiled_function_matches_eager(big_batch):
    cfg = make_config("ppo", "low_var_kl", "truncate", "token-mean")

    def step(logp):
        return policy_loss(logp, big_batch["old_logp"], big_batch["advantages"], big_batch["mask"], cfg=cfg,
                           ref_logp=big_batch["ref_logp"], rollout_logp=big_batch["rollout_logp"],
                           entropy=big_batch["entropy"], cu_seqlens=big_batch["cu_seqlens"])[0] * 2

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        logp = big_batch["logp"].clone().requires_grad_()
        fn(logp).backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1])
