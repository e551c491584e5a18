"""Where the LM-head ops' peak memory beyond their gradients goes, at H=4096, V=151936, T=16384 (GPU).

    python benchmarks/diagnose_lm_head_memory.py --out $OUT/lm-head-memory.json

Runs one child process per case (the libraries' one-time allocations are per process). ``cold`` runs
``fused_linear_logprobs`` first thing; the other cases first run a few tiny plain-PyTorch GEMMs on the main
thread and on autograd's backward thread (``redline.gpu_memory.make_cublas_workspaces``, which
``benchmarks/conftest.py`` runs before any benchmark): ``warm`` (``fused_linear_logprobs``), and
``policy-one-pass`` / ``policy-two-pass`` (``fused_linear_policy_loss`` with its 1 GiB default workspace, the
benchmark's GRPO loss), whose gradients are computed in the forward call.
Each child does three fwd+bwd calls and reports, per call, the forward's peak allocated beyond what was
allocated before it (less the ``[T]`` outputs; the policy loss's forward also holds the two gradients, which
are subtracted), the backward's peak beyond what was allocated before it less the gradients it has to create
(none for the policy loss), and what the backward left allocated beyond the gradients (``backward_kept_mib``:
0 when autograd hands the op's gradient tensors to ``.grad`` itself; the gradients' size when it copies them);
and what the calls left allocated after their outputs and gradients were freed (one-time allocations: cuBLAS
keeps a workspace per thread and stream), with the largest live blocks.
"""

import argparse
import json
import subprocess
import sys

H, V, T = 4096, 151936, 16384
MiB = 2**20
CASES = ("cold", "warm", "policy-one-pass", "policy-two-pass")


def child(case: str) -> dict:
    import torch

    from redline.kernels import LossConfig, fused_linear_logprobs, fused_linear_policy_loss

    if case != "cold":
        from redline.gpu_memory import make_cublas_workspaces

        make_cublas_workspaces()
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(T, H, device="cuda", generator=gen) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * H ** -0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), device="cuda", generator=gen)
    g_logp, g_entropy = torch.randn(T, device="cuda", generator=gen), torch.randn(T, device="cuda", generator=gen)
    old_logp = -torch.rand(T, device="cuda", generator=gen) * 12
    ref_logp = old_logp + torch.randn(T, device="cuda", generator=gen) * 0.1
    advantages = torch.randn(T // 1024, device="cuda", generator=gen).repeat_interleave(1024)
    mask = torch.ones(T, dtype=torch.bool, device="cuda")
    cfg = LossConfig(estimator="ppo", eps_clip=0.2, kl_type="k3", kl_coef=0.04, agg="token-mean")
    grads = (hidden.numel() + weight.numel()) * 2
    policy = case.startswith("policy")

    def forward():
        if policy:
            loss, _ = fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, cfg=cfg,
                                               temperature=0.7, ref_logp=ref_logp, one_pass=case.endswith("one-pass"))
            return [loss], [None], grads + 4  # the gradients and the scalar loss
        logp, entropy = fused_linear_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)
        return [logp, entropy], [g_logp, g_entropy], 2 * T * 4

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    calls = []
    for _ in range(3):
        hidden.grad = weight.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        outputs, upstream, held = forward()
        torch.cuda.synchronize()
        forward_mib = (torch.cuda.max_memory_allocated() - base - held) / MiB
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.backward(outputs, upstream)
        torch.cuda.synchronize()
        created = 0 if policy else grads
        calls.append(dict(forward_mib=forward_mib,
                          backward_mib=(torch.cuda.max_memory_allocated() - base - created) / MiB,
                          backward_kept_mib=(torch.cuda.memory_allocated() - base - created) / MiB))
        del outputs
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - start
    blocks = sorted((b["size"] / MiB for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                     if b["state"] == "active_allocated"), reverse=True)
    return dict(case=case, grads_mib=grads / MiB, peak_beyond_outputs_and_grads_per_call=calls,
                left_allocated_after_first_calls_mib=left / MiB, largest_live_blocks_mib=blocks[:8],
                device=torch.cuda.get_device_name(), torch=torch.__version__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--child", choices=CASES)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    results = []
    for case in args.cases:
        done = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", case], capture_output=True,
                              text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(results[-1])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
