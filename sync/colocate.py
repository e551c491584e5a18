"""The colocated step: trainer and engine take turns on the same GPU, each phase timed.

    train -> pause trainer memory -> engine resumes weights -> sync -> engine resumes KV cache -> generate
          -> engine releases memory -> trainer resumes

The engine is any ``redline.rollout.engine.Engine`` (its memory calls are coroutines); the trainer's memory is
a ``redline.sync.memory.PausableMemory`` (or anything with ``pause``/``resume``). Phase boundaries synchronize
the device so that each phase's GPU work is charged to it; they are natural barriers of the step anyway.
The engine's KV cache comes back only after the sync, so the sync's staging buffers and the new weights never
compete with it for memory (slime's two-stage resume, slime.md §5).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("train", "pause_trainer", "resume_engine_weights", "sync", "resume_engine_kv_cache", "generate",
          "release_engine", "resume_trainer")


@dataclass
class TransitionReport:
    """Seconds per phase (``PHASES`` order) and the device memory still in use while the trainer was paused
    and the engine had not yet resumed (bytes, whole GPU as ``cudaMemGetInfo`` sees it)."""

    seconds: dict[str, float] = field(default_factory=dict)
    paused_device_used_bytes: int | None = None

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def transition(self) -> float:
        """Time of everything but training and generation: what colocation costs per step."""
        return sum(s for name, s in self.seconds.items() if name not in ("train", "generate"))


async def _call(fn: Callable[[], Any]) -> Any:
    result = fn()
    return await result if inspect.isawaitable(result) else result


async def colocated_step(*, train: Callable[[], Any], trainer_memory, engine, sync: Callable[[], Any],
                         generate: Callable[[], Any],
                         device: torch.device | None = None) -> tuple[Any, Any, TransitionReport]:
    """Run one colocated step; returns ``(train result, generate result, report)``.

    ``train()``, ``sync()`` and ``generate()`` may be plain or async callables; ``sync`` moves the trainer's new
    weights into ``engine`` (e.g. ``WeightSender.sync`` into the engine process, or ``engine.update_weights``).
    On entry the engine's memory must be released and the trainer's resumed; on return the same holds.
    """
    report = TransitionReport()
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"

    def barrier():
        if on_gpu:
            torch.cuda.synchronize(device)

    async def phase(name, fn):
        barrier()
        start = time.perf_counter()
        result = await _call(fn)
        barrier()
        report.seconds[name] = time.perf_counter() - start
        return result

    trained = await phase("train", train)
    await phase("pause_trainer", trainer_memory.pause)
    if on_gpu:
        free, total = torch.cuda.mem_get_info(device)
        report.paused_device_used_bytes = total - free
    await phase("resume_engine_weights", lambda: engine.resume_memory({"weights"}))
    await phase("sync", sync)
    await phase("resume_engine_kv_cache", lambda: engine.resume_memory({"kv_cache"}))
    generated = await phase("generate", generate)
    await phase("release_engine", lambda: engine.release_memory({"weights", "kv_cache"}))
    await phase("resume_trainer", trainer_memory.resume)
    return trained, generated, report
