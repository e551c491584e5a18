"""One decode step of attention over a KV cache: a Triton kernel that reads each row's cache once.

``q [B, h, d]`` (one new token per row), caches ``[B, h_kv, S, d]``, ``positions [B]`` int64 → ``[B, h, d]``:
row b attends cache slots ``0..positions[b]`` (padding rows, position -1, attend slot 0 only; their output is
unspecified). Math per row and query head: ``softmax(scale · q Kᵀ) V`` over the visible slots, accumulated
in fp32 with an online softmax (fp32 inputs multiply in full fp32, not TF32).

Why a kernel: SDPA with a ``[B, S]`` mask and grouped-query heads takes PyTorch's math path, which expands
K/V to every query head and reads the whole ``S``-slot cache each step. Here one program handles one
(row, KV head): it loads the cache slots up to the row's position once and serves all query heads of that
group from them. Loop bounds are read on the device, so the step stays capturable in a CUDA graph.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, scale, stride_qb, stride_qh, stride_kb, stride_kh,
                   stride_ks, stride_ob, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    visible = tl.maximum(tl.load(pos_ptr + row), 0) + 1
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    q_ok = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qb + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :], mask=q_ok,
                other=0.0)
    kv_base = row * stride_kb + kv_head * stride_kh
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(0, visible, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        ok = (slots < visible)[:, None] & (d < HEAD_DIM)[None, :]
        offs = kv_base + slots[:, None] * stride_ks + d[None, :]
        k = tl.load(k_ptr + offs, mask=ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where((slots < visible)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=ok, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / total[:, None]
    tl.store(o_ptr + row * stride_ob + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_ok)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """See the module docstring. ``q`` and the caches share one dtype; the caches' last dim is contiguous."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)} with equal strides")
    q = q.contiguous()
    out = torch.empty_like(q)
    group = heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, out, positions.contiguous(), scale, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=64 if block_d <= 128 else 32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out
