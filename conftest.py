"""Shared pytest wiring for tests/ and benchmarks/: hardware/package markers become skips with a reason.

On a machine without a CUDA GPU, Triton kernels run under the interpreter (``TRITON_INTERPRET=1``); the
variable must be set before any ``@triton.jit`` function is defined, so it is set here, at collection start.
"""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

PACKAGE_MARKERS = {
    "te": ("transformer_engine", "TransformerEngine is not installed (pip install 'redline[te]')"),
    "sglang": ("sglang", "SGLang is not installed (pip install 'redline[sglang]')"),
    "ray": ("ray", "Ray is not installed (pip install 'redline[ray]')"),
}


def skip_reason(item) -> str | None:
    """Why ``item`` cannot run here, or None when it can."""
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        return "needs a CUDA GPU; none is visible"
    if item.get_closest_marker("multigpu") and torch.cuda.device_count() < 2:
        return f"needs 2 or more CUDA GPUs; {torch.cuda.device_count()} visible"
    for marker, (module, reason) in PACKAGE_MARKERS.items():
        if item.get_closest_marker(marker) and importlib.util.find_spec(module) is None:
            return reason
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def cuda():
    """The CUDA device for tests marked ``gpu``."""
    return torch.device("cuda")
