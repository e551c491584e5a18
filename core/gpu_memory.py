"""Measuring a GPU op's memory: the libraries' one-time allocations are made before the measurement starts."""

import torch


class _Fp32OutputMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return torch.mm(a, a, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        (a,) = ctx.saved_tensors
        return torch.mm(grad.to(a.dtype), a, out_dtype=torch.float32).to(a.dtype)


def make_cublas_workspaces(device="cuda") -> None:
    """Run tiny bf16 GEMMs forward (this thread) and backward (autograd's thread for ``device``), with bf16 and
    fp32 outputs. cuBLAS and cuBLASLt allocate a workspace (32 MiB each on an H100) per thread and stream at
    their first GEMM there and keep it for the process; made first, it is charged to no measured call."""
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    ((a @ a).float().sum() + _Fp32OutputMatmul.apply(a).sum()).backward()
    torch.cuda.synchronize(device)
