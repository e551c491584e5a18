"""The plain-PyTorch definitions checked against arithmetic done here by hand (and against torch's own CE)."""

import math

import pytest
import torch

from redline.kernels.loss_config import LossConfig
from redline.kernels.reference import (kl_estimate, linear_logprobs_reference, linear_policy_loss_reference,
                                       policy_loss_reference)


def tensor(values):
    return torch.tensor(values, dtype=torch.float64)


def run(logp, old_logp, advantages, cfg, mask=None, **kwargs):
    """(loss, metrics, d loss / d logp) of the reference on fp64 lists."""
    logp = tensor(logp).requires_grad_()
    mask = torch.ones(logp.shape, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, metrics = policy_loss_reference(logp, tensor(old_logp), tensor(advantages), mask, cfg=cfg, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), {k: v.item() for k, v in metrics.items()}, grad.tolist()


def test_ppo_clips_the_ratio_on_the_side_the_advantage_pushes():
    # token 0: r = e^0.2 > 1.2 with A > 0 -> clipped; token 1: r = 1; token 2: r = e^-1 < 0.8 with A > 0 -> unclipped
    loss, metrics, grad = run([-1.0, -0.5, -2.0], [-1.2, -0.5, -1.0], [1.0, -2.0, 0.5], LossConfig(eps_clip=0.2))
    r2 = math.exp(-1.0)
    assert loss == pytest.approx((-1.2 + 2.0 - 0.5 * r2) / 3)
    assert grad == pytest.approx([0.0, 2.0 / 3, -0.5 * r2 / 3])
    assert metrics["clipfrac"] == pytest.approx(1 / 3)
    assert metrics["approx_kl"] == pytest.approx((-0.2 + 0.0 + 1.0) / 3)


def test_clip_higher_raises_only_the_upper_bound():
    # r = e^0.2 = 1.2214: clipped at 1 + 0.2, free under eps_clip_high = 0.28
    loss, metrics, grad = run([-1.0], [-1.2], [1.0], LossConfig(eps_clip=0.2, eps_clip_high=0.28))
    assert loss == pytest.approx(-math.exp(0.2))
    assert grad == pytest.approx([-math.exp(0.2)])
    assert metrics["clipfrac"] == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # A = -1, r = e^1.5 = 4.48 > eps_clip_c = 3: loss -eps_clip_c * A = 3 and no gradient
    loss, metrics, grad = run([0.0], [-1.5], [-1.0], LossConfig(eps_clip_c=3.0))
    assert loss == pytest.approx(3.0)
    assert grad == [0.0]
    assert metrics["clipfrac"] == 1.0


def test_gspo_uses_the_sequence_mean_log_ratio_for_every_token():
    # log-ratios 0.1 and 0.3 -> s = 0.2, r = e^0.2 for both tokens; unclipped with eps_clip_high = 0.28
    cfg = LossConfig(estimator="gspo", eps_clip_high=0.28)
    loss, _, grad = run([-1.0, -1.0], [-1.1, -1.3], [1.0, 1.0], cfg)
    r = math.exp(0.2)
    assert loss == pytest.approx(-r)
    # loss = mean over tokens of -r = -r; each token moves s by 1/2, so d loss / d logp_t = -r / 2
    assert grad == pytest.approx([-r / 2, -r / 2])


def test_cispo_weights_logp_by_the_stopped_clipped_ratio():
    # r = e^0.5 = 1.6487 clipped to 1 + 0.5; loss = -1.5 · A · logp; gradient -1.5 · A (no gradient through r)
    cfg = LossConfig(estimator="cispo", eps_clip=0.2, eps_clip_high=0.5)
    loss, metrics, grad = run([-1.0], [-1.5], [2.0], cfg)
    assert loss == pytest.approx(3.0)
    assert grad == pytest.approx([-3.0])
    assert metrics["clipfrac"] == 1.0


@pytest.mark.parametrize("kl_type,delta,expected", [
    ("k1", 0.5, 0.5),
    ("k2", 0.5, 0.125),
    ("k3", 0.5, math.exp(-0.5) - 1 + 0.5),
    ("k3", -15.0, math.exp(15.0) - 1 - 15.0),
    ("low_var_kl", 0.5, math.exp(-0.5) - 1 + 0.5),
    ("low_var_kl", -15.0, 10.0),
])
def test_kl_estimators(kl_type, delta, expected):
    assert kl_estimate(tensor([delta]), kl_type).item() == pytest.approx(expected)


def test_kl_term_enters_the_loss_with_its_coefficient():
    cfg = LossConfig(kl_type="k2", kl_coef=0.1)
    loss, metrics, grad = run([-1.0], [-1.0], [0.0], cfg, ref_logp=tensor([-1.5]))
    assert metrics["kl"] == pytest.approx(0.125)
    assert loss == pytest.approx(0.1 * 0.125)
    assert grad == pytest.approx([0.1 * 0.5])


@pytest.mark.parametrize("mode,low,expected_weights,expected_outside", [
    ("truncate", 0.0, [2.0, 0.5, 1.0], 1 / 3),
    ("truncate", 0.6, [2.0, 0.6, 1.0], 2 / 3),
    ("icepop", 0.6, [0.0, 0.0, 1.0], 2 / 3),
])
def test_tis_weights(mode, low, expected_weights, expected_outside):
    # w = exp(old - rollout) = 3, 0.5, 1; A = -1 and r = 1 make pg_t = w_t
    cfg = LossConfig(tis=mode, tis_clip_low=low, tis_clip=2.0)
    rollout = tensor([-math.log(3.0), -math.log(0.5), 0.0])
    loss, metrics, _ = run([0.0] * 3, [0.0] * 3, [-1.0] * 3, cfg, rollout_logp=rollout)
    assert loss == pytest.approx(sum(expected_weights) / 3)
    assert metrics["tis_mean"] == pytest.approx(sum(expected_weights) / 3)
    assert metrics["tis_clipfrac"] == pytest.approx(expected_outside)


# x_t = entropy_t (A = 0, entropy_coef = -1): sequence 0 has x = 1, 3; sequence 1 is empty; sequence 2 has x = 5
# and one masked-out token (x = 100, must not count). The seq-mean modes divide by all 3 sequences, the empty
# one included (slime, TRL and verl's engine count a sample with an empty loss mask).
@pytest.mark.parametrize("agg,agg_constant,expected", [
    ("token-mean", None, (1 + 3 + 5) / 3),
    ("seq-mean-token-mean", None, ((1 + 3) / 2 + 0 + 5 / 1) / 3),
    ("seq-mean-token-sum", None, (4 + 0 + 5) / 3),
    ("seq-mean-token-sum-norm", 2.0, (1 + 3 + 5) / (3 * 2.0)),
])
def test_aggregations_over_ragged_sequences(agg, agg_constant, expected):
    cfg = LossConfig(entropy_coef=-1.0, agg=agg, agg_constant=agg_constant)
    entropy = tensor([1.0, 3.0, 5.0, 100.0])
    cu_seqlens = torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    loss, metrics, _ = run([0.0] * 4, [0.0] * 4, [0.0] * 4, cfg, mask=[True, True, True, False], entropy=entropy,
                           cu_seqlens=cu_seqlens)
    assert loss == pytest.approx(expected)
    assert metrics["entropy"] == pytest.approx(expected)


def test_fully_masked_batch_gives_zero_loss_and_zero_gradient():
    cfg = LossConfig(agg="seq-mean-token-mean")
    loss, metrics, grad = run([-1.0, -2.0], [-3.0, 0.0], [1.0, -1.0], cfg, mask=[False, False])
    assert loss == 0.0 and grad == [0.0, 0.0]
    assert all(value == 0.0 for value in metrics.values())


def test_masked_out_overflowing_ratio_does_not_poison_the_loss():
    # the masked-out token's ratio exp(1000) overflows to inf; inf · 0 would make the loss and gradient nan
    logp = torch.tensor([-1.0, 500.0], requires_grad=True)
    loss, _ = policy_loss_reference(logp, torch.tensor([-1.0, -500.0]), torch.tensor([1.0, 1.0]),
                                    torch.tensor([True, False]), cfg=LossConfig(estimator="cispo", eps_clip_high=1.0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_linear_logprobs_match_cross_entropy_and_categorical_entropy():
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    targets = torch.randint(0, 11, (6,))
    logp, entropy = linear_logprobs_reference(hidden, weight, targets, temperature=0.7, return_entropy=True)
    logits = hidden @ weight.T / 0.7
    expected_logp = -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(logp, expected_logp)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())


def test_linear_logprobs_zero_masked_tokens_and_ignore_their_targets():
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    targets = torch.tensor([1, -100, 4])
    mask = torch.tensor([True, False, True])
    logp, entropy = linear_logprobs_reference(hidden, weight, targets, mask=mask, return_entropy=True)
    assert logp[1] == 0 and entropy[1] == 0
    assert logp.dtype == torch.float32 and (logp[mask] < 0).all()


def test_linear_logprobs_compute_bf16_inputs_in_fp32():
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 4).bfloat16(), torch.randn(5, 4).bfloat16()
    targets = torch.tensor([0, 1, 2])
    expected = torch.log_softmax(hidden.float() @ weight.float().T, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(linear_logprobs_reference(hidden, weight, targets), expected)


def test_linear_policy_loss_is_logprobs_then_policy_loss():
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    targets, mask = torch.randint(0, 7, (5,)), torch.tensor([True, True, False, True, True])
    old_logp, advantages = -torch.rand(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    cfg = LossConfig(estimator="gspo", entropy_coef=0.01, agg="seq-mean-token-mean")
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    loss, metrics = linear_policy_loss_reference(hidden, weight, targets, old_logp, advantages, mask, cfg=cfg,
                                                 temperature=0.9, cu_seqlens=cu_seqlens)
    logp, entropy = linear_logprobs_reference(hidden, weight, targets, temperature=0.9, mask=mask,
                                              return_entropy=True)
    expected, expected_metrics = policy_loss_reference(logp, old_logp, advantages, mask, cfg=cfg, entropy=entropy,
                                                       cu_seqlens=cu_seqlens)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics, expected_metrics)


@pytest.mark.parametrize("kwargs,argument", [
    (dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 6)), "hidden"),
    (dict(targets=torch.tensor([0, 1])), "targets"),
    (dict(targets=torch.tensor([0, 1, 2], dtype=torch.int32)), "targets"),
    (dict(mask=torch.tensor([1, 1, 1])), "mask"),
    (dict(temperature=0.0), "temperature"),
])
def test_linear_logprobs_reject_bad_arguments(kwargs, argument):
    args = dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 4), targets=torch.tensor([0, 1, 2]))
    args.update(kwargs)
    hidden, weight, targets = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError, match=argument):
        linear_logprobs_reference(hidden, weight, targets, **args)
