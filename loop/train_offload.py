"""``--offload-train``: the trainer's state in pausable memory, paused while the colocated engine generates.

Where it lives. ``MasterWeights`` asks ``TrainOffload.allocate`` for every buffer it keeps on the GPU — the
compute weights, the fp32 main grads, the fp32 master shard and (through ``MixedPrecisionAdamW``) the Adam
moments — and gets ``redline.sync.memory.PausableMemory.zeros``: one native allocation per buffer, so each can
be released on its own and comes back at the same address (parameters stay views of it).

The plan (``OffloadPlan``, made at each pause from the buffers alive then) says what happens to each group:

* gradients: dropped; zeros on resume (every step starts from zero gradients);
* compute weights: dropped and rebuilt from the fp32 master weights on resume (``MasterWeights.publish``: the
  optimizer writes the compute weights as the rounded masters, so the rebuild is bit-exact) when the masters
  are in this memory; with ``--optimizer-cpu-offload`` (masters in host memory) placed like the optimizer
  state below (they are what the GPU cannot rebuild then: stay, or pinned host memory, 154 ms each way for the
  7.5 GiB of the Qwen3-4B shape on an H100);
* master weights and Adam moments: stay on the GPU (``optimizer_resident``) or go to pinned host memory (made
  once, reused by every later pause). Their copies, 12 bytes a parameter each way over PCIe (19.2 GiB at the
  Qwen3-1.7B shape: 0.86 s a step on the H100), are most of the pause and resume, where unmapping the rest and
  rebuilding the compute weights take milliseconds (51.5 ms with them resident). So ``--offload-train-optimizer
  auto`` (the default) keeps them resident when the engine fits beside them: at start-up, paused with them
  resident, the GPU's free memory is measured against the engine's need (``engine_memory``: SGLang's
  ``--sglang-mem-fraction-static`` share of the GPU, or the embedded engine's weights and fixed KV cache, plus
  ``ENGINE_HEADROOM``), and only when it does not fit do they go to the host (``place_optimizer``); ``host``
  and ``gpu`` force either. The run's metrics time each group (``perf/pause_train_<group>_time``,
  ``perf/resume_train_map_time``, ``perf/resume_train_rebuild_time``) and the start-up plan table gives its
  bytes: the plan's cost measured.

When. The weight push reads the compute weights, so the pause has two stages (``redline.loop.weight_sync``):
``pause_state`` (everything but the compute weights, then the cached blocks of activations and temporaries
given back to the driver when the engine's memory would not fit otherwise: ``make_room``) before the engine
takes its weights back, ``pause_weights`` after the push; ``resume`` once the engine
has released its memory after the rollout, before the log-prob phase. The engine also starts beside a paused
trainer (``pause``, both stages, before it is built): the state is paused whenever the engine holds memory.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch
from redline.loop.training_memory import size as _size
from redline.trainer.mixed_precision import MasterWeights

ACTIONS = {"zeros": "dropped; zeros on resume",
           "rebuild": "dropped; rebuilt from the fp32 master weights on resume",
           "host": "kept in pinned host memory",
           "stay": "stays on the GPU (--offload-train-optimizer)"}
STATE, WEIGHTS = "state", "weights"  # the stages: before the engine resumes its weights, after the push
# what an engine takes beyond its weights and KV cache (CUDA context, activations, CUDA graphs): the state the
# GPU cannot rebuild stays only where this is free too
ENGINE_HEADROOM = 2**30


def offload_train_enabled(config) -> bool:
    """``--offload-train`` as set, else on with a colocated SGLang engine (slime's ``--colocate``) on a CUDA GPU
    (the only place SGLang runs; the CPU tests' stand-in servers keep it off) and off otherwise."""
    from redline.loop.rollout_setup import resolve_engine

    if config.train.offload_train is not None:
        return config.train.offload_train
    return config.parallel.colocate and resolve_engine(config) == "sglang" and torch.cuda.is_available()


@dataclass(frozen=True)
class PlanGroup:
    """One group of the trainer's state (``key``: its short name): what the pause does to it (``ACTIONS``), at
    which stage, its buffers,
    the device bytes the pause releases (allocations rounded to the driver's granularity) and the bytes copied
    to pinned host memory at the pause (and back at resume)."""

    name: str
    key: str  # in its metric's name: perf/pause_train_<key>_time
    action: str
    stage: str
    tensors: tuple[torch.Tensor, ...]
    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class OffloadPlan:
    groups: tuple[PlanGroup, ...]

    def stage(self, stage: str) -> list[PlanGroup]:
        return [g for g in self.groups if g.stage == stage]

    @property
    def device_bytes(self) -> int:
        return sum(g.device_bytes for g in self.groups)

    @property
    def host_bytes(self) -> int:
        return sum(g.host_bytes for g in self.groups)

    def table(self) -> list[str]:
        """Markdown: one row per group, then the totals."""
        lines = ["| state | while the engine generates | released on the GPU | pinned host |",
                 "| --- | --- | ---: | ---: |"]
        for g in self.groups:
            lines.append(f"| {g.name} | {ACTIONS[g.action]} | {_size(g.device_bytes)} | {_size(g.host_bytes)} |")
        lines.append(f"| all | | {_size(self.device_bytes)} | {_size(self.host_bytes)} |")
        return lines


@dataclass(frozen=True)
class OptimizerPlacement:
    """``--offload-train-optimizer auto``'s choice at start-up: ``kept`` (the state the GPU cannot rebuild: the
    masters and moments, or with ``--optimizer-cpu-offload`` the compute weights) stays on the GPU (``resident``)
    when the engine's need (``engine_bytes``: ``engine``'s parts, ``ENGINE_HEADROOM`` included) fits in
    ``free_bytes``, the GPU's free memory measured with the rest of the trainer paused."""

    resident: bool
    engine_bytes: int
    free_bytes: int
    engine: str  # how engine_bytes was found
    kept: str  # the groups' names

    def line(self) -> str:
        """The start-up line: the decision and the numbers it used."""
        where = "stay on the GPU" if self.resident else "go to pinned host memory"
        verb = "fits in" if self.resident else "does not fit in"
        return (f"{self.kept} {where} while the engine generates (--offload-train-optimizer auto): "
                f"the engine needs {_size(self.engine_bytes)} ({self.engine}), which {verb} the "
                f"{_size(self.free_bytes)} free with the rest paused")


class TrainOffload:
    """The trainer's pausable state: ``allocate`` (a ``MasterWeights`` allocator), ``track`` (each
    ``MasterWeights`` made with it), then per step ``pause_state`` → ``pause_weights`` → ``resume``.
    ``memory``: a ``PausableMemory`` (its host imitation in the CPU tests)."""

    def __init__(self, memory):
        self.memory = memory
        self.device = memory.device
        self._masters: list[weakref.ref] = []
        self._moments: list[weakref.ref] = []
        self.plan: OffloadPlan | None = None  # the plan of the pause in progress (None: resident)
        self.stage: str | None = None  # the last stage paused, None while resident
        self.cache_bytes = 0  # the caching allocator's reserved bytes after the state's pause (make_room)
        # what the GPU cannot rebuild stays there (--offload-train-optimizer): the masters and moments, or with
        # --optimizer-cpu-offload (masters in host memory) the compute weights
        self.optimizer_resident = False
        self.placement: OptimizerPlacement | None = None  # --offload-train-optimizer auto's start-up choice
        # seconds of the last pause (perf/pause_train_<key>_time per group, perf/pause_train_cache_time for
        # make_room) or the last resume (perf/resume_train_map_time: every allocation mapped back and the kept
        # contents copied in; perf/resume_train_rebuild_time: the compute weights rebuilt), measured around
        # synchronised device work: the plan's cost, group by group
        self.timings: dict[str, float] = {}

    @property
    def paused(self) -> bool:
        return self.stage is not None

    def allocate(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``MasterWeights``' ``allocate``: ``[numel]`` zeros in pausable memory (moments remembered here, the
        other kinds reached through their ``MasterWeights``)."""
        tensor = self.memory.zeros(numel, dtype)
        if kind == "moment":
            self._moments.append(weakref.ref(tensor))
        return tensor

    def track(self, master: MasterWeights) -> MasterWeights:
        """Remember ``master`` (made with ``allocate``) for the plan and the rebuild; returns it."""
        self._masters.append(weakref.ref(master))
        return master

    def masters(self) -> list[MasterWeights]:
        return [m for m in (ref() for ref in self._masters) if m is not None]

    def make_plan(self) -> OffloadPlan:
        """The plan for the state alive now (an optimizer dropped since, like the SFT warm-up's, is gone); a
        ``RuntimeError`` when no ``MasterWeights`` is tracked (the state would stay resident unnoticed)."""
        if not self.masters():
            raise RuntimeError(f"--offload-train: no MasterWeights tracked by the TrainOffload on {self.device}: the "
                               "trainer's state was not allocated through it and would stay on the GPU")
        kept = "stay" if self.optimizer_resident else "host"  # what the GPU cannot rebuild
        compute = {"rebuild": [], "host": [], "stay": []}
        grads, masters = [], []
        for m in self.masters():  # masters in host memory (--optimizer-cpu-offload) cannot rebuild them on the GPU
            compute[kept if m.offload else "rebuild"] += [g.compute for g in m.groups]
            grads += [g.main_grad for g in m.groups]
            if not m.offload:
                masters += [g.master for g in m.groups]
        moments = [t for t in (ref() for ref in self._moments) if t is not None]
        specs = [("gradients (fp32 main grad)", "grads", "zeros", STATE, grads),
                 ("master weights (fp32)", "masters", kept, STATE, masters),
                 ("Adam moments (fp32)", "moments", kept, STATE, moments)]
        specs += [("compute weights", "compute", action, WEIGHTS, compute[action]) for action in compute]
        return OffloadPlan(tuple(self._group(*spec) for spec in specs if spec[-1]))

    def _group(self, name: str, key: str, action: str, stage: str, tensors: list[torch.Tensor]) -> PlanGroup:
        device = sum(self.memory.allocation_bytes(t) for t in tensors) if action != "stay" else 0
        host = sum(t.untyped_storage().nbytes() for t in tensors) if action == "host" else 0
        return PlanGroup(name, key, action, stage, tuple(tensors), device, host)

    def pause_state(self, room_bytes: int | None = None) -> None:
        """Stage one: gradients, master weights and moments paused by the plan, then the cached blocks of
        activations and other temporaries given back to the driver (``make_room``: only when fewer than
        ``room_bytes`` are free then, the engine's need; always when None). Waits for all queued device work."""
        if self.paused:
            return
        self.plan, self.timings = self.make_plan(), {}
        self._pause(self.plan.stage(STATE))
        self.stage = STATE
        if self.device.type == "cuda":
            with self._timed("perf/pause_train_cache_time"):
                make_room(self.device, room_bytes)
            self.cache_bytes = torch.cuda.memory_reserved(self.device)

    def pause_weights(self) -> None:
        """Stage two, after the push has read them: the compute weights paused by the plan."""
        if self.stage != STATE:
            raise RuntimeError(f"TrainOffload.pause_weights: the state must be paused first (stage {self.stage})")
        self._pause(self.plan.stage(WEIGHTS))
        self.stage = WEIGHTS

    def pause(self) -> None:
        """Both stages at once (nothing needs the compute weights meanwhile: before the engine starts)."""
        self.pause_state()
        self.pause_weights()

    def place_optimizer(self, engine_bytes: int, engine: str) -> OptimizerPlacement:
        """``--offload-train-optimizer auto`` at start-up, once ``pause`` ran with ``optimizer_resident`` and
        before the engine takes its memory: the GPU's free memory measured (``device_memory``) against the
        engine's ``engine_bytes`` (``engine``: how they were found). When they do not fit, what stayed (the
        masters and moments, or with ``--optimizer-cpu-offload`` the compute weights) goes to pinned host memory
        now and at every later pause."""
        if self.stage != WEIGHTS or not self.optimizer_resident:
            raise RuntimeError("TrainOffload.place_optimizer: pause with the optimizer state resident first "
                               f"(stage {self.stage}, optimizer_resident {self.optimizer_resident})")
        free = device_memory(self.device)[0]
        kept = {g.key for g in self.plan.groups if g.action == "stay"}
        self.placement = OptimizerPlacement(engine_bytes <= free, engine_bytes, free, engine,
                                            " and ".join(g.name for g in self.plan.groups if g.action == "stay"))
        if not self.placement.resident:
            self.optimizer_resident = False
            self.plan = self.make_plan()
            self._pause([g for g in self.plan.groups if g.action == "host" and g.key in kept])
        return self.placement

    def _pause(self, groups: list[PlanGroup]) -> None:
        """Each group on its own (its copies to pinned host waited for), timed."""
        self._synchronize()  # the queued work the first group would otherwise be charged with
        for g in (g for g in groups if g.action != "stay"):
            with self._timed(f"perf/pause_train_{g.key}_time"):
                self.memory.pause_tensors(list(g.tensors), [g.action == "host"] * len(g.tensors))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def _timed(self, metric: str):
        """Adds the block's seconds, its device work included, to ``timings[metric]``."""
        start = time.perf_counter()
        yield
        self._synchronize()
        self.timings[metric] = self.timings.get(metric, 0.0) + time.perf_counter() - start

    @torch.no_grad()
    def resume(self) -> None:
        """Everything paused mapped back at the same addresses, kept contents restored, gradients zeroed and the
        dropped compute weights rebuilt from the master weights (gathered over data parallelism)."""
        if not self.paused:
            return
        self.timings = {}
        self._synchronize()
        with self._timed("perf/resume_train_map_time"):
            self.memory.resume()
            for group in self.plan.groups:
                if group.action == "zeros":
                    for t in group.tensors:
                        t.zero_()
        if any(g.action == "rebuild" and g.stage == self.stage for g in self.plan.groups):
            with self._timed("perf/resume_train_rebuild_time"):
                for m in self.masters():
                    if not m.offload:
                        m.publish()
        self.stage, self.plan = None, None

    def residual_bytes(self) -> int:
        """GPU memory the paused trainer still holds: the caching allocator's blocks after the state's pause
        (tensors outside pausable memory: the reference model, buffers, sync staging; with an in-process engine
        also what the engine keeps while released) and the pausable allocations still mapped."""
        return self.cache_bytes + self.memory.stats()["mapped_bytes"]


def make_room(device: torch.device, room_bytes: int | None) -> bool:
    """Give the caching allocator's unused blocks on CUDA ``device`` back to the driver (``torch.cuda.empty_cache``,
    tens of ms at GPU scale: 34–44 ms at the Qwen3-1.7B shape on an H100 and an H200, needed or not) unless
    ``room_bytes`` (None: never enough) are free already; True when it did."""
    if room_bytes is not None and device_memory(device)[0] >= room_bytes:
        return False
    torch.cuda.empty_cache()
    return True


def device_memory(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of the GPU as the driver sees it (every process's use counted); ``(0, 0)`` off CUDA."""
    return tuple(torch.cuda.mem_get_info(device)) if device.type == "cuda" else (0, 0)


def engine_memory(config, hf_config, dtype: torch.dtype, total_bytes: int) -> tuple[int, str]:
    """``(bytes, how)``: the GPU memory the colocated engine takes while it generates, ``ENGINE_HEADROOM``
    included, and the parts it was found from (for the start-up line). SGLang: its static share
    (``rollout_setup.sglang_mem_fraction``; its weights and KV cache) × ``total_bytes``, the GPU's total memory
    (SGLang takes the share of the memory free when it starts, so planning on the total errs on the safe side).
    The embedded engine: its own ``dtype`` copy of the weights plus its KV cache, fixed by the config (K and V of every layer for
    ``engine_rows`` rows × ``engine_seq_len`` slots and the scratch slot, as ``KVCache`` allocates it)."""
    from redline.loop.rollout_setup import (
        engine_rows,
        engine_seq_len,
        model_context,
        resolve_engine,
        sglang_mem_fraction,
    )
    from redline.trainer.layers import layer_backend
    from redline.trainer.models.decoder import DecoderModel

    headroom = f"{_size(ENGINE_HEADROOM)} headroom"
    if resolve_engine(config) == "sglang":
        fraction = sglang_mem_fraction(config)
        given = "" if config.rollout.sglang_mem_fraction_static is not None else " (its default here)"
        return (int(fraction * total_bytes) + ENGINE_HEADROOM,
                f"--sglang-mem-fraction-static {fraction:g}{given} × {_size(total_bytes)} + {headroom}")
    meta = DecoderModel(hf_config, layer_backend("bf16"), dtype=dtype, device="meta")  # sizes only, no memory
    weights = sum(p.numel() * p.element_size() for p in meta.parameters())
    rows, slots = engine_rows(config), engine_seq_len(config, model_context(hf_config))
    spec = meta.spec
    kv = 2 * spec.num_layers * rows * spec.num_kv_heads * (slots + 1) * spec.head_dim * dtype.itemsize
    return (weights + kv + ENGINE_HEADROOM,
            f"weights {_size(weights)} + KV cache {_size(kv)} ({rows} rows × {slots} slots) + {headroom}")


def train_offload(device: torch.device | str) -> TrainOffload:
    """The process's ``TrainOffload`` on ``device`` (the native allocator is one per process), ``device`` taken as
    a tensor made there reports it: the loop names a colocated trainer's GPU ``cuda`` while the parameters'
    ``MasterWeights`` ask with ``cuda:0``, and both must reach the one that tracks the state (keyed by the name
    as given, the loop paused an empty ``TrainOffload`` on the H100: nothing but ``empty_cache``)."""
    return _train_offload(torch.empty(0, device=device).device)


@cache
def _train_offload(device: torch.device) -> TrainOffload:
    from redline.sync.memory import PausableMemory

    return TrainOffload(PausableMemory(device))


def check_available() -> None:
    """What ``--offload-train`` needs, or the reason it cannot run: a CUDA GPU and redline's native library
    (``NativeLibraryMissing``'s message says how to build it)."""
    from redline.sync.memory import load_native, native_library_path

    if not torch.cuda.is_available():
        raise RuntimeError("it pauses the trainer's GPU memory and needs a CUDA GPU; none is visible")
    load_native(str(native_library_path()))


def trainer_of(weight_sync) -> TrainOffload | None:
    return getattr(weight_sync, "train", None)


def ensure_resident(state) -> None:
    """Before the trainer works outside a step (SFT, a restore, the warm-up): when ``--offload-train`` left its
    state paused, the engine releases its memory (``--offload-rollout``) and the state comes back, as after a
    rollout; the next push gives the engine its memory and weights back."""
    offload = trainer_of(state.weight_sync)
    if offload is not None and offload.paused:
        state.loop.run_until_complete(state.weight_sync.release())


@contextmanager
def trainer_resident(state, version: str):
    """The trainer's state readable inside the block (a checkpoint, an export). When ``--offload-train`` had
    paused it, the engine's memory is released first (with ``--offload-rollout``) and the engine gets weights
    ``version`` back after, through the usual push (which pauses the trainer again)."""
    offload = trainer_of(state.weight_sync)
    paused = offload is not None and offload.paused
    if paused:
        state.loop.run_until_complete(state.weight_sync.release())
    yield
    if paused:
        state.loop.run_until_complete(state.weight_sync.push(version))
