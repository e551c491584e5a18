"""Native FP8: ``torch._scaled_mm`` linear layers with current (tensorwise / rowwise) scaling.

``scaling`` holds the numerics contract (TE ``Float8CurrentScaling``'s formulas) as plain PyTorch, which is
also the reference the Triton kernels in ``cast`` are tested against; ``linear`` is the autograd Function and
the ``native`` layer backend.
"""
