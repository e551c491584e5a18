"""Where one decoder layer's fwd+bwd spends its GPU time: GPU ms by kernel category, then the top kernels.

    python benchmarks/profile_layers.py [--backend bf16|native-tensorwise|te-current|...] [--shape llama3-8b|qwen3-8b]
        [--attention auto|te|redline] [--out FILE]

Uses the same model, shapes and step as ``bench_layers.py`` (16,384 tokens, 4 sequences). The category table
(``bench_layers.kernel_category``: gemm, attention, fp8_cast, norm, comm, copy, other) separates what a target
miss is made of; ``wall`` is the step's CUDA-event time, so ``wall - kernels`` is time the GPU sat idle
(launch gaps, host syncs). The core attention that ran is printed first.
"""

import argparse
from pathlib import Path

import torch

from bench_layers import (BACKENDS, CATEGORIES, SEQUENCES, SHAPES, TOKENS, attention_impl, cuda_time_ms,
                          kernel_breakdown, stack_step)
from redline.trainer.layers import layer_backend
from redline.trainer.models import from_config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="bf16", choices=list(BACKENDS))
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--attention", choices=("auto", "te", "redline"), help="te backends: core attention")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    name, options = BACKENDS[args.backend]
    if args.attention:
        if name != "te":
            parser.error("--attention applies to the te backends only")
        options = {**options, "attention": args.attention}
    model = from_config(SHAPES[args.shape](1), backend=layer_backend(name, **options), dtype=torch.bfloat16,
                        device="cuda", seed=0)
    hidden = torch.randn(TOKENS, model.spec.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_seqlens = torch.arange(0, TOKENS + 1, TOKENS // SEQUENCES, device="cuda", dtype=torch.int32)
    step = stack_step(model, hidden, cu_seqlens, torch.randn_like(hidden))
    wall = cuda_time_ms(step)
    breakdown, prof = kernel_breakdown(step)
    lines = [f"{args.backend} {args.shape} x1 fwd+bwd, {TOKENS} tokens: attention {attention_impl(model)}",
             f"{'category':<12} {'GPU ms':>9} {'share':>7}"]
    for category in CATEGORIES:
        ms = breakdown[f"{category}_ms"]
        lines.append(f"{category:<12} {ms:9.3f} {ms / wall:7.1%}")
    lines += [f"{'kernels':<12} {breakdown['kernels_ms']:9.3f} {breakdown['kernels_ms'] / wall:7.1%}",
              f"{'wall':<12} {wall:9.3f}", "",
              prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
