"""Where ``fused_linear_logprobs``'s peak memory beyond its gradients goes, at H=4096, V=151936, T=16384 (GPU).

    python benchmarks/diagnose_lm_head_memory.py --out $OUT/lm-head-memory.json

Runs two child processes (the libraries' one-time allocations are per process): ``cold`` runs the op first
thing, ``warm`` first runs a few tiny plain-PyTorch GEMMs on the main thread and on autograd's backward thread
(``redline.gpu_memory.make_cublas_workspaces``, which ``benchmarks/conftest.py`` runs before any benchmark).
Each child does three fwd+bwd calls with per-token upstream gradients of logp and entropy and reports, per
call, the forward's peak allocated beyond what was allocated before it, less the two ``[T]`` outputs, and the
backward's, less the two gradients; and what the calls left allocated after their outputs and gradients were
freed (one-time allocations: cuBLAS keeps a workspace per thread and stream), with the largest live blocks.
"""

import argparse
import json
import subprocess
import sys

H, V, T = 4096, 151936, 16384
MiB = 2**20


def child(warm: bool) -> dict:
    import torch

    from redline.kernels import fused_linear_logprobs

    if warm:
        from redline.gpu_memory import make_cublas_workspaces

        make_cublas_workspaces()
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(T, H, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * H ** -0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), device="cuda", generator=gen)
    g_logp, g_entropy = torch.randn(T, device="cuda", generator=gen), torch.randn(T, device="cuda", generator=gen)
    grads = (hidden.numel() + weight.numel()) * 2
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    calls = []
    for _ in range(3):
        hidden.grad = weight.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        logp, entropy = fused_linear_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)
        torch.cuda.synchronize()
        forward = torch.cuda.max_memory_allocated() - base - 2 * T * 4  # beyond the two [T] fp32 outputs
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.backward([logp, entropy], [g_logp, g_entropy])
        torch.cuda.synchronize()
        calls.append(dict(forward_mib=forward / MiB,
                          backward_mib=(torch.cuda.max_memory_allocated() - base - grads) / MiB))
        del logp, entropy
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - start
    blocks = sorted((b["size"] / MiB for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                     if b["state"] == "active_allocated"), reverse=True)
    return dict(mode="warm" if warm else "cold", peak_beyond_outputs_and_grads_per_call=calls,
                left_allocated_after_first_calls_mib=left / MiB, largest_live_blocks_mib=blocks[:8],
                device=torch.cuda.get_device_name(), torch=torch.__version__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--child", choices=["cold", "warm"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "warm")))
        return
    results = []
    for mode in ("cold", "warm"):
        done = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", mode], capture_output=True,
                              text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(results[-1])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
