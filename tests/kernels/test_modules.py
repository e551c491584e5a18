"""The nn.Module wrappers call the functional ops with their stored settings."""

import torch

from redline.kernels import FusedLinearLogprobs, FusedLinearPolicyLoss, LossConfig
from redline.kernels import fused_linear_logprobs, fused_linear_policy_loss


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(11, 8, generator=gen), torch.randn(30, 8, generator=gen), torch.randint(0, 30, (11,),
                                                                                               generator=gen)


def test_logprobs_module_equals_the_function():
    hidden, weight, targets = _inputs()
    module = FusedLinearLogprobs(temperature=0.6, return_entropy=True)
    got = module(hidden, weight, targets)
    expected = fused_linear_logprobs(hidden, weight, targets, temperature=0.6, return_entropy=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_policy_loss_module_equals_the_function():
    hidden, weight, targets = _inputs()
    old_logp, advantages, mask = -torch.rand(11) * 4, torch.randn(11), torch.rand(11) > 0.3
    cfg = LossConfig(eps_clip=0.1)
    loss, metrics = FusedLinearPolicyLoss(cfg, temperature=0.6)(hidden, weight, targets, old_logp, advantages, mask)
    ref_loss, ref_metrics = fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, cfg=cfg,
                                                     temperature=0.6)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(metrics["clipfrac"], ref_metrics["clipfrac"])
