"""Which backend each subsystem uses on this machine; the single place that decides it."""

from dataclasses import dataclass

import torch

from redline.extras import available

FP8_MIN_CAPABILITY = (8, 9)  # Ada/Hopper and later have FP8 tensor cores


@dataclass(frozen=True)
class Backends:
    kernels: str  # "triton" | "torch reference"
    fp8: str  # "te" | "native" | "off"
    rollout: str  # "sglang" | "embedded"


def gpu_has_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY


def select_backends() -> Backends:
    gpu = torch.cuda.is_available()
    kernels = "triton" if gpu and available("triton") else "torch reference"
    if gpu_has_fp8():
        fp8 = "te" if available("transformer_engine") else "native"
    else:
        fp8 = "off"
    rollout = "sglang" if gpu and available("sglang") else "embedded"
    return Backends(kernels=kernels, fp8=fp8, rollout=rollout)
