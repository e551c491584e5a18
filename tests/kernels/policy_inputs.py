"""The small LM-head policy-loss batch shared by test_linear_policy_loss.py and test_linear_policy_loss_one_pass.py,
and ``run``, the call the one-pass tests (ppo/cispo and gspo) make."""

import torch

from redline.kernels import fused_linear_policy_loss
from redline.kernels.reference import linear_logprobs_reference

T, H, V = 29, 16, 141
TEMPERATURE = 0.8
CU_SEQLENS = torch.tensor([0, 7, 7, 19, 29], dtype=torch.int32)  # includes an empty sequence


def make_inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = torch.randn(V, H, generator=gen).to(dtype)
    targets = torch.randint(0, V, (T,), generator=gen)
    mask = torch.rand(T, generator=gen) > 0.25
    mask[19:] = False  # the last sequence is entirely masked
    logp = linear_logprobs_reference(hidden.double(), weight.double(), targets, temperature=TEMPERATURE).float()
    # old/ref/rollout log-probs near the current ones so ratios fall on both sides of the clip bounds
    near = [logp + 0.3 * torch.randn(T, generator=gen) for _ in range(3)]
    return dict(hidden=hidden, weight=weight, targets=targets, mask=mask, advantages=torch.randn(T, generator=gen),
                old_logp=near[0], ref_logp=near[1], rollout_logp=near[2])


def run(inputs, cfg, cu_seqlens=CU_SEQLENS, **options):
    """(loss, metrics, d_hidden, d_weight) of fused_linear_policy_loss on ``inputs`` (``make_inputs``' keys) at
    TEMPERATURE, gradients of 2.5·loss."""
    hidden = inputs["hidden"].clone().requires_grad_()
    weight = inputs["weight"].clone().requires_grad_()
    loss, metrics = fused_linear_policy_loss(hidden, weight, inputs["targets"], inputs["old_logp"],
                                             inputs["advantages"], inputs["mask"], cfg=cfg, temperature=TEMPERATURE,
                                             ref_logp=inputs["ref_logp"], rollout_logp=inputs["rollout_logp"],
                                             cu_seqlens=cu_seqlens, **options)
    (2.5 * loss).backward()
    return loss.detach(), metrics, hidden.grad, weight.grad
