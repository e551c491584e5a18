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
    got = discounted_returns(rewards, torch.ones(4, dtype=torch.bool), cu, gamma=0.5)
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
    adv, ret = gae(rewards, values, torch.ones(2, dtype=torch.bool), torch.tensor([0, 2]), gamma, lam)
    assert torch.allclose(adv, torch.tensor([d0 + gamma * lam * d1, d1]))
    assert torch.allclose(ret, adv + values)


# One multi-turn response: model tokens 0-1, a tool-output span 2-3 outside the loss mask, model tokens 4-5;
# then a response of one token with no span.
TURNS_MASK = torch.tensor([True, True, False, False, True, True, True])
TURNS_CU = torch.tensor([0, 6, 7])


def test_reinforce_plus_plus_return_restarts_below_a_masked_span():
    # γ = 0.5, by hand backwards through the first response (verl: a masked-out token keeps its own return and
    # resets the running return to 0 before the token ahead of it):
    #   t5: 1.0   t4: 0.5 + 0.5·1.0 = 1.0   t3 (out): 0.4 + 0.5·1.0 = 0.9 → running 0
    #   t2 (out): 0.3 + 0 = 0.3 → running 0   t1: 0.2 + 0 = 0.2   t0: 0.1 + 0.5·0.2 = 0.2
    rewards = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 1.0, 2.0])
    got = discounted_returns(rewards, TURNS_MASK, TURNS_CU, gamma=0.5)
    assert torch.allclose(got, torch.tensor([0.2, 0.2, 0.3, 0.9, 1.0, 1.0, 2.0]))


def test_gae_skips_tokens_outside_the_loss_mask():
    # γ = 0.9, λ = 0.8; the masked-out tokens' rewards (0.5) and values (9) must not enter. By hand:
    #   t5: δ = 1 − 0.6 = 0.4, A = 0.4
    #   t4: δ = 0.9·0.6 − 0.4 = 0.14, A = 0.14 + 0.72·0.4 = 0.428
    #   t3, t2 (out): A carried = 0.428; next value stays V_4 = 0.4
    #   t1: δ = 0.9·0.4 − 0.2 = 0.16, A = 0.16 + 0.72·0.428 = 0.46816
    #   t0: δ = 0.9·0.2 − 0.1 = 0.08, A = 0.08 + 0.72·0.46816 = 0.4170752
    #   second response: δ = 2 − 0.5 = 1.5
    rewards = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 1.0, 2.0])
    values = torch.tensor([0.1, 0.2, 9.0, 9.0, 0.4, 0.6, 0.5])
    adv, ret = gae(rewards, values, TURNS_MASK, TURNS_CU, gamma=0.9, lambd=0.8)
    expected = torch.tensor([0.4170752, 0.46816, 0.428, 0.428, 0.428, 0.4, 1.5])
    assert torch.allclose(adv, expected)
    assert torch.allclose(ret, expected + values)


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl's GAE recursion, transcribed on the padded ``[bs, response_length]`` layout (float mask)."""
    nextvalues, lastgaelam, out = 0.0, 0.0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        candidate = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = candidate * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values


def verl_reinforce_plus_plus_returns(token_level_rewards, response_mask, gamma):
    """verl's REINFORCE++ return recursion, transcribed on the padded layout (float mask)."""
    returns, running = torch.zeros_like(token_level_rewards), 0.0
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * response_mask[:, t]
    return returns


def random_multi_turn_batch(seed):
    """Packed ``(rewards, values, loss_mask, cu_resp)`` of ragged responses with random masked-out spans, and the
    same batch right-padded as verl holds it (padding outside the mask)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (6,), generator=g)
    lengths[2] = 11  # one response spans the full width
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(cu[-1])
    rewards, values = torch.randn(total, generator=g), torch.randn(total, generator=g)
    loss_mask = torch.rand(total, generator=g) < 0.6
    width = int(lengths.max())
    padded = [torch.zeros(len(lengths), width) for _ in range(3)]
    for i in range(len(lengths)):
        span = slice(int(cu[i]), int(cu[i + 1]))
        for dst, src in zip(padded, (rewards, values, loss_mask.float())):
            dst[i, :int(lengths[i])] = src[span]
    valid = torch.arange(width)[None] < lengths[:, None]
    return (rewards, values, loss_mask, cu), padded, valid


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_verls_recursion(seed):
    (rewards, values, loss_mask, cu), (r, v, m), valid = random_multi_turn_batch(seed)
    adv, ret = gae(rewards, values, loss_mask, cu, gamma=0.95, lambd=0.9)
    want_adv, want_ret = verl_gae(r, v, m, 0.95, 0.9)
    assert torch.allclose(adv, want_adv[valid], atol=1e-6)
    assert torch.allclose(ret, want_ret[valid], atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_plus_plus_returns_match_verls_recursion(seed):
    (rewards, _, loss_mask, cu), (r, _, m), valid = random_multi_turn_batch(seed)
    got = discounted_returns(rewards, loss_mask, cu, gamma=0.9)
    assert torch.allclose(got, verl_reinforce_plus_plus_returns(r, m, 0.9)[valid], atol=1e-6)


def test_estimators_pass_the_loss_mask_to_the_recursions():
    # reinforce_plus_plus: terminal reward 1 on the last token of the first response; γ = 1. The running return
    # restarts below the masked span, so tokens 0-1 get return 0 and tokens 4-5 get 1; whitening is over the mask.
    rewards = torch.tensor([1.0, 0.0])
    adv, _ = compute_advantages("reinforce_plus_plus", rewards, torch.tensor([0, 1]), TURNS_CU, TURNS_MASK)
    raw = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0])  # the masked tokens' returns
    assert torch.allclose(adv[TURNS_MASK], (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8), atol=1e-5)
    # ppo: zero values, γ = λ = 1 → A = 1 on every masked token of the first response (the reward carries over
    # the span), 0 on the second; returns likewise
    _, returns = compute_advantages("ppo", rewards, torch.tensor([0, 1]), TURNS_CU, TURNS_MASK,
                                    values=torch.zeros(7))
    assert torch.equal(returns, torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]))


def test_a_loss_mask_that_is_not_bool_over_the_responses_is_refused():
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        gae(torch.zeros(7), torch.zeros(7), TURNS_MASK.float(), TURNS_CU, 1.0, 1.0)
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        discounted_returns(torch.zeros(7), TURNS_MASK[:5], TURNS_CU, 1.0)


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
