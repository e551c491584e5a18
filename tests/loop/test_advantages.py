"""Advantage estimators against values computed by hand."""

import math

import pytest
import torch

from redline.loop.advantages import (AdaptiveKLController, compute_advantages, discounted_returns, gae,
                                     group_centered, leave_one_out, masked_whiten)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
CU = torch.tensor([0, 2, 3, 5, 6, 8, 9])  # response lengths 2, 1, 2, 1, 2, 1
MASK = torch.ones(9, dtype=torch.bool)


def test_grpo_centres_and_scales_by_group_std():
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal → 0
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0]) / torch.tensor([math.sqrt(1 / 3)] * 4 + [1e9] * 2)
    got = group_centered(REWARDS, GROUPS, std_normalize=True)
    assert torch.allclose(got[:4], expected[:4], atol=1e-5)
    assert torch.equal(got[4:], torch.zeros(2))


def test_dr_grpo_does_not_divide_by_std():
    adv, returns = compute_advantages("dr_grpo", REWARDS, GROUPS, CU, MASK)
    assert returns is None
    assert torch.allclose(adv, torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5, 0.5, 0, 0, 0]))


def test_grpo_broadcasts_to_every_response_token():
    adv, _ = compute_advantages("grpo", REWARDS, GROUPS, CU, MASK)
    a = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([a, a, -a, -a, -a, a, 0, 0, 0]), atol=1e-4)


def test_rloo_uses_the_other_samples_mean():
    got = leave_one_out(REWARDS, GROUPS)
    assert torch.allclose(got, torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0, 0]))


def test_kl_in_reward_is_honoured_by_group_estimators():
    kl = torch.full((9,), 0.5)
    plain, _ = compute_advantages("grpo", REWARDS, GROUPS, CU, MASK)
    with_kl, _ = compute_advantages("grpo", REWARDS, GROUPS, CU, MASK, kl=kl, kl_coef=0.1)
    assert torch.allclose(plain - with_kl, torch.full((9,), 0.05))
    with pytest.raises(ValueError, match="kl_coef > 0 needs the per-token kl"):
        compute_advantages("grpo", REWARDS, GROUPS, CU, MASK, kl_coef=0.1)


def test_discounted_returns_within_each_response():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    cu = torch.tensor([0, 3, 4])
    got = discounted_returns(rewards, cu, gamma=0.5)
    assert torch.allclose(got, torch.tensor([1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 4.0]))


def test_reinforce_plus_plus_puts_reward_on_last_token_then_whitens():
    rewards = torch.tensor([1.0, 0.0])
    cu = torch.tensor([0, 2, 3])
    mask = torch.ones(3, dtype=torch.bool)
    adv, _ = compute_advantages("reinforce_plus_plus", rewards, torch.tensor([0, 0]), cu, mask, gamma=1.0)
    raw = torch.tensor([1.0, 1.0, 0.0])  # returns with γ = 1
    expected = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    assert torch.allclose(adv, expected, atol=1e-5)


def test_gae_matches_hand_recursion():
    rewards = torch.tensor([0.0, 1.0])
    values = torch.tensor([0.5, 0.25])
    gamma, lam = 0.9, 0.8
    d1 = 1.0 + 0 - 0.25
    d0 = 0.0 + gamma * 0.25 - 0.5
    adv, ret = gae(rewards, values, torch.tensor([0, 2]), gamma, lam)
    assert torch.allclose(adv, torch.tensor([d0 + gamma * lam * d1, d1]))
    assert torch.allclose(ret, adv + values)


def test_masked_whiten_ignores_masked_entries():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    got = masked_whiten(x, mask)
    assert torch.allclose(got[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-4)
    assert got[3] == 100.0


def test_adaptive_kl_controller_moves_towards_target():
    ctl = AdaptiveKLController(0.1, target=0.05, horizon=100)
    assert ctl.update(current_kl=0.5, n_samples=10) == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    assert ctl.update(current_kl=0.0, n_samples=10) < 0.1 * 1.02
