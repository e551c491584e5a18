"""Time ``fused_linear_policy_loss``'s one-pass path (PPO, GRPO settings of ``bench_lm_head``) at forced
``(token chunk, vocab chunk)`` plans, to check ``lm_head_plan``'s choice on the GEMM path that runs
(``REDLINE_LM_HEAD_GEMM``).

    python3 benchmarks/probe_one_pass_plans.py OUT.json [--tokens 16384] [PLAN ...]   (PLAN: tokens,vocab)

Median ms of 10 fwd+bwd calls after 3 warm-ups per plan, beside the plan the model picks. CUDA only.
"""

import argparse
import json
import sys

import torch
from cuda_timing import cuda_time_ms

from redline.env_report import collect
from redline.kernels import LossConfig, fused_linear_policy_loss
from redline.kernels import linear_policy_loss as policy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("plans", nargs="*", help="tokens,vocab")
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args(argv)
    t, h, v = args.tokens, 4096, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) * h ** -0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (t,), device="cuda", generator=gen)
    old_logp = -torch.rand(t, device="cuda", generator=gen) * 12
    advantages = torch.randn(t, device="cuda", generator=gen)
    mask = torch.ones(t, dtype=torch.bool, device="cuda")
    cfg = LossConfig(estimator="ppo", eps_clip=0.2, kl_type="k3", kl_coef=0.04, agg="token-mean")

    def step():
        hidden.grad = weight.grad = None
        loss, _ = fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, cfg=cfg,
                                           temperature=0.7, ref_logp=old_logp, workspace_bytes=2**30, one_pass=True)
        loss.backward()

    chosen = policy.one_pass_plan
    results = dict(environment=collect(), tokens=t, runs=[])

    def model_plan(*shape):
        results["model_plan"] = chosen(*shape)
        return results["model_plan"]

    for plan in [None] + [tuple(map(int, p.split(","))) for p in args.plans]:
        if plan is None:
            policy.one_pass_plan = model_plan
        else:
            policy.one_pass_plan = lambda *a, plan=plan, **k: plan
        ms = cuda_time_ms(step)
        results["runs"].append(dict(plan=plan or "model", ms=round(ms, 2)))
        print(plan or "model", round(ms, 2), flush=True)
    policy.one_pass_plan = chosen
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
