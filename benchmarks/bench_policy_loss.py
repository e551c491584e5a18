"""Policy loss forward + backward at T = 1M tokens in S = 1024 packed sequences (ppo and gspo).

Providers: redline (the Triton kernels behind ``policy_loss``), the fp32 reference in eager PyTorch (baseline)
and ``torch.compile`` of that reference. Every provider computes the same loss (KL + entropy + TIS + dual clip
on), then the gradients of logp and entropy. Each row also records how many GPU kernels one call launches
(``kernels_per_call``) and their summed GPU time (``kernel_us``, from the profiler): the gap between that and
the wall time is host work (Python, dispatch, launches). Target: redline >= 5x faster than eager.
"""

import pytest
import torch

from redline.kernels.loss_config import LossConfig
from redline.kernels.policy_loss import policy_loss
from redline.kernels.reference import policy_loss_reference

pytestmark = pytest.mark.gpu
NUM_TOKENS, NUM_SEQS = 1 << 20, 1024
CONFIGS = {
    "ppo": LossConfig(estimator="ppo", eps_clip_high=0.28, eps_clip_c=3.0, kl_type="low_var_kl", kl_coef=0.01,
                      entropy_coef=0.001, tis="truncate", agg="token-mean"),
    "gspo": LossConfig(estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4, kl_type="low_var_kl", kl_coef=0.01,
                       entropy_coef=0.001, tis="truncate", agg="seq-mean-token-mean"),
}


def packed_batch():
    """Random per-token inputs of 1024 sequences of random lengths (a few empty), 80% of tokens trained on."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    cuts = torch.randint(0, NUM_TOKENS + 1, (NUM_SEQS - 1,), device="cuda", generator=gen).sort().values
    edges = torch.tensor([0, NUM_TOKENS], device="cuda")
    cu_seqlens = torch.cat([edges[:1], cuts, edges[1:]]).to(torch.int32)

    def noise(scale):
        return scale * torch.randn(NUM_TOKENS, device="cuda", generator=gen)

    logp = -3 * torch.rand(NUM_TOKENS, device="cuda", generator=gen)
    old_logp = logp + noise(0.2)
    return dict(logp=logp, old_logp=old_logp, advantages=noise(1.0),
                mask=torch.rand(NUM_TOKENS, device="cuda", generator=gen) < 0.8, ref_logp=logp + noise(0.3),
                rollout_logp=old_logp + noise(0.1), entropy=2 * torch.rand(NUM_TOKENS, device="cuda", generator=gen),
                cu_seqlens=cu_seqlens)


def kernel_profile(fn) -> dict:
    """``kernels_per_call`` and ``kernel_us`` (their summed GPU time) of one call of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    return dict(kernels_per_call=len(kernels), kernel_us=sum(event.time_range.elapsed_us() for event in kernels))


PROVIDERS = {
    "redline (Triton)": policy_loss,
    "torch eager reference": policy_loss_reference,
    "torch.compile reference": torch.compile(policy_loss_reference),
}


@pytest.mark.parametrize("estimator", CONFIGS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_policy_loss_fwd_bwd(gpu_bench, provider, estimator):
    batch = packed_batch()
    logp = batch.pop("logp").requires_grad_()
    entropy = batch.pop("entropy").requires_grad_()
    loss_fn, cfg = PROVIDERS[provider], CONFIGS[estimator]

    def step():
        logp.grad = entropy.grad = None
        loss, metrics = loss_fn(logp, entropy=entropy, cfg=cfg, **batch)
        loss.backward()
        return loss.detach(), metrics["clipfrac"]

    step()  # compile / autotune outside the count
    gpu_bench(step, group=f"policy loss fwd+bwd {estimator} T=1M S=1024", provider=provider,
              baseline=provider == "torch eager reference", rounds=30, warmup=5, T=NUM_TOKENS, S=NUM_SEQS,
              estimator=estimator, **kernel_profile(step))
