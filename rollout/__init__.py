"""redline.rollout: engines (embedded, SGLang), prompt data, rewards, filters and the rollout manager.

See README.md in this folder for the contracts; ``redline.rollout.engine.Engine`` is the interface the loop
and the sync path use.
"""

if __name__ != "redline.rollout":  # pragma: no cover - the repository root is on sys.path
    # This folder is the package redline.rollout. Imported under its bare folder name (as libraries probing for
    # a top-level "rollout" package do when the repository root is on sys.path), it would register its ops and
    # classes a second time; hand out the real package instead.
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("redline.rollout")
