"""redline.trainer"""

if __name__ != "redline.trainer":  # pragma: no cover - the repository root is on sys.path
    # This folder is the package redline.trainer. Imported under its bare folder name (as libraries probing for
    # a top-level "trainer" package do when the repository root is on sys.path), it would register its ops and
    # classes a second time; hand out the real package instead.
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("redline.trainer")
