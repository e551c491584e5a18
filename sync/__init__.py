"""redline.sync: trainer -> engine weight sync (bucket plan, pipelined CUDA-IPC protocol, NCCL broadcast) and
colocation memory (pausable VMM pool, the colocated step sequence). See sync/README.md for the contract."""

if __name__ != "redline.sync":  # pragma: no cover - the repository root is on sys.path
    # This folder is the package redline.sync. Imported under its bare folder name (as libraries probing for
    # a top-level "sync" package do when the repository root is on sys.path), it would register its ops and
    # classes a second time; hand out the real package instead.
    import importlib as _importlib
    import sys as _sys

    _sys.modules[__name__] = _importlib.import_module("redline.sync")
