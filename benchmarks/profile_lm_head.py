"""Where the LM-head ops' fwd+bwd spends its GPU time: the step's CUDA-event time, the kernels' sum (the rest is
time the GPU sat idle: launch gaps, host work) and the top kernels.

    python benchmarks/profile_lm_head.py [--op logprobs|policy] [--tokens 16384] [--hidden 4096]
        [--vocab 151936] [--out FILE] [--trace FILE.json]

Same inputs and step as ``bench_lm_head.py``: ``logprobs`` is ``fused_linear_logprobs`` with entropy and per-token
upstream gradients; ``policy`` is the benchmark's GRPO loss through ``fused_linear_policy_loss`` (default path and
workspace). ``REDLINE_LM_HEAD_GEMM`` applies as usual.
"""

import argparse
from pathlib import Path

import torch

from bench_layers import cuda_time_ms, kernel_breakdown
from bench_lm_head import TEMPERATURE, _inputs, _policy_inputs, _run_fwd_bwd


def logprobs_step(h: int, v: int, t: int):
    from redline.kernels import fused_linear_logprobs

    hidden, weight, targets, g_logp, g_entropy = _inputs(h, v, t)

    def fn():
        return fused_linear_logprobs(hidden, weight, targets, temperature=TEMPERATURE, return_entropy=True)

    return lambda: _run_fwd_bwd(fn, hidden, weight, g_logp, g_entropy)


def policy_step(h: int, v: int, t: int):
    from redline.kernels import LossConfig, fused_linear_policy_loss

    hidden, weight, targets, old_logp, ref_logp, advantages, mask = _policy_inputs(h, v, t)
    cfg = LossConfig(estimator="ppo", eps_clip=0.2, kl_type="k3", kl_coef=0.04, agg="token-mean")

    def step():
        hidden.grad = weight.grad = None
        fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, cfg=cfg,
                                 temperature=TEMPERATURE, ref_logp=ref_logp)[0].backward()

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("logprobs", "policy"), default="logprobs")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--trace", help="also write a Chrome trace (host and GPU) of one more step to this file")
    args = parser.parse_args()
    step = (logprobs_step if args.op == "logprobs" else policy_step)(args.hidden, args.vocab, args.tokens)
    wall = cuda_time_ms(step)
    breakdown, prof = kernel_breakdown(step)
    kernels = breakdown["kernels_ms"]
    lines = [f"{args.op} fwd+bwd H={args.hidden} V={args.vocab} T={args.tokens}: wall {wall:.3f} ms, "
             f"kernels {kernels:.3f} ms, GPU idle {wall - kernels:.3f} ms",
             prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
