"""The colocated transition's two overlaps: the trainer's pause while the engine resumes its weights, and the
trainer's resume while the engine releases its memory (``redline.loop.weight_sync``).

Each pair is one call into the engine's process (SGLang's memory calls, an embedded engine process's) and one
piece of the trainer's device work; they touch different memory, so they may run at once when the GPU has room for
both at their peak: the engine's resume beside the trainer's state not yet paused, the trainer's resume beside the
engine's memory not yet released. Whether it has is read from the driver's free memory (``device_memory``) against
what the engine's (or trainer's) side took at the last time it ran alone, so the first transition of a run always
runs one after the other and measures it. ``REDLINE_OVERLAP_TRANSITION=0`` keeps them apart always.

How the pair is timed keeps the phase's parts adding up to its wall time: the engine's call gets its own seconds,
the trainer's work the seconds it ran past the engine's call (``exposed``), and the seconds it ran under it go to
a ``*_hidden_time`` metric of their own, outside ``redline.loop.metrics.PHASE_PARTS``.
"""

import asyncio
import time
from dataclasses import dataclass

import torch
from redline.devices import device_scope
from redline.loop.train_offload import device_memory

OVERLAP_ENV = "REDLINE_OVERLAP_TRANSITION"


@dataclass(frozen=True)
class PairTimes:
    """Seconds from the pair's start: the engine's call (``engine``), the trainer's device work past it
    (``exposed``) and under it (``hidden``); ``engine + exposed`` is the pair's wall time."""
    engine: float
    exposed: float
    hidden: float


def has_room(device: torch.device, need_bytes: int, headroom_bytes: int) -> bool:
    """Whether ``need_bytes`` (0: never measured) plus ``headroom_bytes`` are free on ``device`` now; always False
    off CUDA where ``device_memory`` reports nothing free."""
    return need_bytes > 0 and device_memory(device)[0] >= need_bytes + headroom_bytes


async def side_by_side(engine_call, trainer_work, device: torch.device) -> PairTimes:
    """Await ``engine_call`` (a coroutine) while ``trainer_work()`` runs on a worker thread with ``device`` current,
    its queued device work waited for; both run to their end before the first error (if any) is raised."""
    start = time.perf_counter()

    async def engine_side() -> float:
        await engine_call
        return time.perf_counter() - start

    def trainer_side() -> float:
        with device_scope(device):
            trainer_work()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.perf_counter() - start

    results = await asyncio.gather(engine_side(), asyncio.to_thread(trainer_side), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    engine_s, trainer_s = results
    return PairTimes(engine_s, max(trainer_s - engine_s, 0.0), min(trainer_s, engine_s))
