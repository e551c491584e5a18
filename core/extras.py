"""Optional dependencies: import them lazily and fail with the extra that provides them."""

import functools
import importlib
import importlib.util
import importlib.metadata
from types import ModuleType

# module name -> (distribution name for version lookup, extra that installs it)
OPTIONAL = {
    "triton": ("triton", "gpu"),
    "pynvml": ("nvidia-ml-py", "gpu"),
    "flash_attn": ("flash-attn-4", "gpu"),
    "quack": ("quack-kernels", "gpu"),
    "transformer_engine": ("transformer_engine", "te"),
    "sglang": ("sglang", "sglang"),
    "sglang_router": ("sglang-router", "sglang"),
    "ray": ("ray", "ray"),
    "aiohttp": ("aiohttp", "sglang"),
    "wandb": ("wandb", "wandb"),
    "pyarrow": ("pyarrow", "data"),
    "sympy": ("sympy", "data"),
    "math_verify": ("math-verify", "data"),
}


class MissingExtraError(ImportError):
    """A feature needs an optional package that is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise MissingExtraError naming the extra to install for ``feature``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        dist, extra = OPTIONAL.get(module, (module, None))
        hint = f"pip install 'redline[{extra}]'" if extra else f"pip install {dist}"
        raise MissingExtraError(f"{feature} needs the package '{dist}', which is not installed: {hint}") from exc


def available(module: str) -> bool:
    """True when ``module`` can be found without importing it."""
    return importlib.util.find_spec(module) is not None


@functools.cache
def import_error(module: str) -> str | None:
    """Why ``module`` does not import (``"ExcType: message"``), or None when it does. A package can be found and
    still fail to load (a flash-attn-4 wheel next to a mismatched CUTLASS DSL): this says why. Imports it once;
    cached."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to load means the feature is unavailable
        return f"{type(exc).__name__}: {exc}"
    return None


def importable(module: str) -> bool:
    """True when ``module`` imports (found *and* loadable; see ``import_error``)."""
    return import_error(module) is None


def version(module: str) -> str | None:
    """Installed version of an optional package's distribution, or None when it is missing."""
    dist = OPTIONAL.get(module, (module, None))[0]
    for name in (dist, module):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
