"""Where one decoder layer's fwd+bwd spends its GPU time: the top CUDA kernels under torch.profiler.

    python benchmarks/profile_layers.py [--backend bf16|native-tensorwise|...] [--shape llama3-8b|qwen3-8b]

Uses the same model, shapes and step as ``bench_layers.py`` (16,384 tokens, 4 sequences).
"""

import argparse

import torch

from bench_layers import BACKENDS, SHAPES, SEQUENCES, TOKENS, stack_step
from redline.trainer.layers import layer_backend
from redline.trainer.models import from_config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="bf16", choices=list(BACKENDS))
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    name, options = BACKENDS[args.backend]
    model = from_config(SHAPES[args.shape](1), backend=layer_backend(name, **options), dtype=torch.bfloat16,
                        device="cuda", seed=0)
    hidden = torch.randn(TOKENS, model.spec.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_seqlens = torch.arange(0, TOKENS + 1, TOKENS // SEQUENCES, device="cuda", dtype=torch.int32)
    step = stack_step(model, hidden, cu_seqlens, torch.randn_like(hidden))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
