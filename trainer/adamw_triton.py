"""One-pass AdamW over fp32 master weights that also writes the rounded compute weights.

Per element, with ``g = grad / grad_scale`` (``grad_scale``: a device scalar, so no host sync)::

    p ← p · (1 − lr · weight_decay)
    m ← β1 · m + (1 − β1) · g
    v ← β2 · v + (1 − β2) · g²
    p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + eps)
    compute ← round(p)

torch's ``_fused_adamw_`` does the same update (in that order) but writes the unscaled gradient back and leaves
the rounded copy to another pass: 40 bytes moved per parameter instead of 30 (fp32 master, moments and gradient
read; master and moments written; bf16 compute written).
"""

from redline.extras import require
from redline.trainer.layers.triton_rounding import round_to

triton = require("triton", "the mixed-precision optimizer's GPU update")
tl = triton.language

BLOCK = 4096


@triton.jit
def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, compute_ptr, grad_scale_ptr, n, lr,
                  beta1, beta2, eps, decay, step_size, bias_correction2_sqrt, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0) / tl.load(grad_scale_ptr)
    p = tl.load(master_ptr + offsets, mask=inside, other=0.0) * decay
    m = beta1 * tl.load(exp_avg_ptr + offsets, mask=inside, other=0.0) + (1 - beta1) * grad
    v = beta2 * tl.load(exp_avg_sq_ptr + offsets, mask=inside, other=0.0) + (1 - beta2) * grad * grad
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(master_ptr + offsets, p, mask=inside)
    tl.store(exp_avg_ptr + offsets, m, mask=inside)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=inside)
    tl.store(compute_ptr + offsets, round_to(p, compute_ptr.dtype.element_ty), mask=inside)


def adamw_publish(master, grad, exp_avg, exp_avg_sq, compute, grad_scale, *, step: int, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float) -> None:
    """The update above, in place, over contiguous ``[n]`` tensors: ``master``, ``grad``, ``exp_avg``,
    ``exp_avg_sq`` fp32; ``compute`` the model's dtype; ``grad_scale`` a one-element fp32 tensor on their device;
    ``step``: the step count after this update (1 on the first)."""
    n = master.numel()
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, compute, grad_scale, n, lr, beta1, beta2, eps, 1 - lr * weight_decay,
        lr / (1 - beta1**step), (1 - beta2**step) ** 0.5, BLOCK=BLOCK)
