"""Keeping Python's cyclic garbage collector off the objects a process holds for its whole run.

A full collection scans every tracked object. After start-up a ``redline train`` process tracks ~420k objects
(torch, transformers, the model, the data). On the CPU machine each full collection paused the process for
150-220 ms, about every 3 s of the quickstart's steps; the longest step was 2.2x the median. Frozen objects
(``gc.freeze``) are left out of those scans. ``REDLINE_GC_FREEZE=0`` leaves the collector as Python sets it.
"""

import contextlib
import gc
import os


def _enabled() -> bool:
    return os.environ.get("REDLINE_GC_FREEZE", "1") != "0"


def freeze_long_lived() -> None:
    """Collect the garbage there is, then move every object still alive out of the collector's generations
    (``gc.freeze``), for a process that keeps them until it ends: an engine process, the rollout manager actor.
    Cycles among the frozen objects are not collected until ``gc.unfreeze``."""
    if _enabled():
        gc.collect()
        gc.freeze()


@contextlib.contextmanager
def long_lived_frozen():
    """``freeze_long_lived`` for the block. After it, ``gc.unfreeze``: what the block's owner drops (a run's model,
    in a process that runs several) can be collected again. The freeze is process-wide, so blocks in threads of
    one process share it."""
    freeze_long_lived()
    try:
        yield
    finally:
        if _enabled():
            gc.unfreeze()
