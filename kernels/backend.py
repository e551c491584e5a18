"""Which implementation a kernel call runs: Triton for CUDA tensors, PyTorch for CPU tensors.

``REDLINE_KERNELS_BACKEND=torch|triton`` overrides the choice for every op; ``triton`` on CPU tensors runs
Triton's interpreter and needs ``TRITON_INTERPRET=1``.
``REDLINE_LM_HEAD_GEMM=auto|cublas|triton|triton-dz|cute|cute-dz`` picks the Triton path's LM-head GEMMs
(``lm_head_gemm``).
"""

import os

import torch

BACKEND_ENV = "REDLINE_KERNELS_BACKEND"
# the Triton path's LM-head GEMMs: cuBLAS + epilogue kernels, GEMMs with the epilogue inside (Triton's, or QuACK's
# CuTe-DSL ones), or (default) decided per call
LM_HEAD_GEMM_ENV = "REDLINE_LM_HEAD_GEMM"
# which fused kernels each choice runs: ``stats`` (the forward's statistics, and the one-pass loss's statistics +
# kept offsets), ``dz`` (the two-pass backward's recompute + dz); from ``lm_head_gemm_triton`` or ``lm_head_gemm_cute``
# (``lm_head_gemm_module``)
LM_HEAD_GEMM_KERNELS = {"cublas": (), "triton": ("stats", "dz"), "triton-dz": ("dz",), "cute": ("stats", "dz"),
                        "cute-dz": ("dz",)}
# the default: each call picks (``linear_logprobs_triton.auto_fused_dz``)
LM_HEAD_GEMM_AUTO = "auto"


def choose(device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device``; raises naming the variable when it is wrong."""
    choice = os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    if choice not in ("torch", "triton"):
        raise ValueError(f"{BACKEND_ENV} must be 'torch' or 'triton', got {choice!r}")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{BACKEND_ENV}=triton on {device} tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return choice


def import_triton_module(name: str):
    """Import ``redline.kernels.<name>`` (a Triton module), or say which extra provides triton."""
    import importlib

    try:
        return importlib.import_module(f"redline.kernels.{name}")
    except ImportError as exc:
        if "triton" not in str(exc):
            raise
        raise ImportError("redline.kernels needs triton for CUDA tensors: pip install 'redline[gpu]'") from exc


def lm_head_gemm() -> str:
    """``"auto"`` (default: decided per call), or a key of ``LM_HEAD_GEMM_KERNELS``: ``"cublas"``, ``"triton"``
    (every ``lm_head_gemm_triton`` kernel), ``"triton-dz"`` (its backward dz kernel only), ``"cute"`` / ``"cute-dz"``
    (the same with ``lm_head_gemm_cute``); raises naming the variable when it is wrong."""
    choice = os.environ.get(LM_HEAD_GEMM_ENV) or LM_HEAD_GEMM_AUTO
    if choice != LM_HEAD_GEMM_AUTO and choice not in LM_HEAD_GEMM_KERNELS:
        choices = ", ".join(map(repr, (LM_HEAD_GEMM_AUTO, *LM_HEAD_GEMM_KERNELS)))
        raise ValueError(f"{LM_HEAD_GEMM_ENV} must be one of {choices}, got {choice!r}")
    return choice


def lm_head_gemm_module(choice: str) -> str:
    """The module (under ``redline.kernels``) whose fused GEMMs a ``LM_HEAD_GEMM_KERNELS`` choice runs."""
    return "lm_head_gemm_cute" if choice.startswith("cute") else "lm_head_gemm_triton"
