"""``round_to``: fp32 -> a narrower float in a Triton kernel, rounded to nearest even on every target.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run the kernels) truncates fp32 -> bf16, while
the GPU rounds to nearest even; rounding bf16 by hand gives both the GPU's bits (for normal numbers: the
interpreter also mangles fp32 subnormals), so CPU tests can check the kernels bit for bit. It costs a few
integer operations per element in kernels bound by memory traffic.
"""

from redline.extras import require

triton = require("triton", "the fused elementwise kernels")
tl = triton.language


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` as ``dtype`` (bf16, fp16 or fp32), rounded to nearest even; NaN stays NaN."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, x, rounded)  # NaN: its payload could carry into inf
    return x.to(dtype)
