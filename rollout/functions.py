"""User extension points given by path (``--custom-rm-path pkg.mod:fn`` and the like), slime-style."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable


def load_function(path: str, *, what: str, must_be_async: bool = False) -> Callable:
    """Import ``"package.module:function"``; errors name ``what`` (e.g. "--custom-rm-path") and the path."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what}: '{path}' is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what}: cannot import module '{module_name}' of '{path}': {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{what}: module '{module_name}' has no attribute '{attr}' (from '{path}')")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{what}: '{path}' is not callable")
    if must_be_async and not inspect.iscoroutinefunction(obj):
        raise TypeError(f"{what}: '{path}' must be an 'async def' function")
    return obj
