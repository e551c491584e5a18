"""Keeping Python's cyclic garbage collector off the objects a process holds for its whole run.

A full collection scans every tracked object, and a ``redline train`` process holds many from its start (torch,
transformers, the model, the data). On the CPU machine the quickstart's loop paid 4 full collections in 60 steps,
206-247 ms each, and its longest step took 383-450 ms against a median of 165-209 ms. Frozen (``gc.freeze``),
those objects are left out of the scans: the loop's full collections took 5-6 ms in all, its longest step
208-243 ms (``benchmarks/results/loop/gc-freeze-cpu/``). SGLang's server processes are asked to do the same
before the loop (``freeze_engine_servers``). ``REDLINE_GC_FREEZE=0`` leaves every collector as Python sets it.
"""

import contextlib
import gc

from redline.switches import env_switch

FREEZE_ENV = "REDLINE_GC_FREEZE"  # "0": leave the collector as Python sets it


def freeze_long_lived() -> None:
    """Collect the garbage there is, then move every object still alive out of the collector's generations
    (``gc.freeze``), for a process that keeps them until it ends: an engine process, the rollout manager actor.
    Cycles among the frozen objects are not collected until ``gc.unfreeze``."""
    if env_switch(FREEZE_ENV):
        gc.collect()
        gc.freeze()


def freeze_engine_servers(engine, loop) -> list[str]:
    """``freeze_long_lived`` in the server processes of ``engine`` (or of each of its ``engines``) that take the
    request (SGLang's ``/freeze_gc``: its tokenizer manager, scheduler and detokenizer), run on ``loop``; the URLs of
    servers without the route, for the caller to name. Engines in redline's own processes freeze themselves.
    Nothing with ``REDLINE_GC_FREEZE=0``."""
    if not env_switch(FREEZE_ENV):
        return []
    servers = [e for e in getattr(engine, "engines", [engine]) if hasattr(e, "freeze_gc")]
    return [url for server in servers for url in loop.run_until_complete(server.freeze_gc())]


@contextlib.contextmanager
def long_lived_frozen():
    """``freeze_long_lived`` for the block. After it, ``gc.unfreeze``: what the block's owner drops (a run's model,
    in a process that runs several) can be collected again. The freeze is process-wide, so blocks in threads of
    one process share it."""
    frozen = env_switch(FREEZE_ENV)
    if frozen:
        freeze_long_lived()
    try:
        yield
    finally:
        if frozen:
            gc.unfreeze()
