"""The trainer → engine weight push of the RL loop, through ``redline.sync``'s bucket plan.

The plan (``redline.sync.plan.plan_for``) is made once from the model's HF-named export: dtype-homogeneous
buckets of at most ``--update-weight-buffer-size`` bytes, a layer's tensors never split. Every colocated push
goes through ``redline.sync`` and is checked (``WeightSync``): into the embedded engine process by the
pipelined protocol (persistent staging slots mapped once, the trainer packing bucket k+1 while the engine loads
bucket k, per-bucket checksums) or zero-copy out of the trainer's flat compute buffers; into the in-process
embedded engine by pack + fused load with checksums (on a GPU) or direct copies compared afterwards; into SGLang by one
``FlattenedTensorBucket`` payload per bucket (``SGLangEngine`` packs the next while the server loads the
current), checked with the servers' ``/weights_checker`` hashes. Checks read every 16th row of a bucket by
default and every row with ``--check-weights``; a mismatch raises, naming the buckets.

With ``--offload-rollout`` the engine gives its memory back after each rollout and the push follows the
colocated sequence of ``redline.rollout.engine``: ``resume_memory({"weights"})`` → ``update_weights`` →
``resume_memory({"kv_cache"})``, so the new weights land before the KV cache competes for memory. What it gives
back is ``--offload-rollout-level`` (``offload_tags``): with ``kv_cache`` alone its weights stay and the push loads
into them directly.

With ``--offload-train`` (``redline.loop.train_offload``) the trainer's state is paused around it: gradients,
master weights and moments before the engine resumes its weights, the compute weights once the push (and its
check) has read them, both timed as ``perf/pause_train_time``; the GPU memory the paused trainer still holds is
``perf/trainer_paused_bytes``; each group's share is ``perf/pause_train_<group>_time``. The trainer resumes at the
next ``release`` (``perf/resume_train_time``: ``perf/resume_train_map_time`` and ``_rebuild_time``), before the
log-prob phase. Its memory cannot cross CUDA IPC, so the engine process gets the pipelined protocol.

With ``--no-colocate`` (``BroadcastWeightSync``) the engines run on other GPUs (embedded engine processes also on
the CPU of a CPU machine): the trainer is rank 0 of a ``redline.sync.broadcast`` weight-update group, built the way
SGLang builds it, and the engines' GPUs the next ranks; every push broadcasts the plan's buckets (NCCL on GPUs,
gloo on the CPU) while the engines receive and load them. Embedded engine processes post their receives from the
plan and the push ends with the group's checksum comparison (a mismatch raises ``ChecksumMismatch``); SGLang
servers get each bucket announced by ``/update_weights_from_distributed`` just before its broadcast, and with
``--check-sglang-weights`` (or ``--check-weights``) their parameter hashes are compared afterwards, as on the
colocated path.
"""

import asyncio
import os
import time
from datetime import timedelta

import torch
from redline.devices import device_scope
from redline.loop.train_offload import device_memory, make_room
from redline.rollout.engine import MEMORY_TAGS
from redline.ports import free_port
from redline.switches import env_switch
from redline.sync.plan import WeightPlan, named_buckets, plan_for
from redline.sync.protocol import SyncError
from redline.sync.zero_copy import plan_in_place

SAMPLED_ROW_STRIDE = 16  # the default check reads every 16th 8 KiB row of a bucket (and its last)
IN_PROCESS_ENV = "REDLINE_IN_PROCESS_SYNC"
# 0: the engine process gets the pipelined protocol even where zero-copy applies
ZERO_COPY_ENV = "REDLINE_SYNC_ZERO_COPY"
# 0: the embedded engine keeps its own copy of the weights even where it could read the trainer's in place
SHARE_ENV = "REDLINE_SYNC_SHARE"
CACHE_HEADROOM = 2**30  # bytes beyond the engine's own that must be free before the trainer's cache is left alone


def in_process_mode(device: torch.device) -> str:
    """``REDLINE_IN_PROCESS_SYNC``: ``direct`` (the engine copies the export, one copy, then the bytes are compared)
    or ``staged`` (pack + fused load, two copies, checksums in the same passes). Default: ``staged`` on a GPU, where
    it measured faster (H100, Qwen3-1.7B shape: update_weights 54 ms against 102, sync 11.0 ms against 57.2;
    ``benchmarks/results/sync/loop-sync-h100``), ``direct`` on the CPU (unmeasured there)."""
    mode = os.environ.get(IN_PROCESS_ENV, "staged" if device.type == "cuda" else "direct")
    if mode not in ("direct", "staged"):
        raise ValueError(f"{IN_PROCESS_ENV} must be 'direct' or 'staged', got {mode!r}")
    return mode


def _base(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _offset(tensor: torch.Tensor) -> int:
    """Bytes from the start of ``tensor``'s storage."""
    return tensor.data_ptr() - _base(tensor)


def _clock(device: torch.device) -> float:
    """Seconds, after ``device``'s queued work (each phase is charged its own GPU time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def describe_plan(plan: WeightPlan) -> str:
    sizes = [b.nbytes for b in plan.buckets]
    return f"{len(sizes)} buckets, {plan.nbytes / 2**20:.1f} MiB (largest {max(sizes) / 2**20:.1f} MiB)"


class WeightSync:
    """Owns the bucket plan, the engine's memory state between rollouts and the check of every push.

    ``model``: a ``redline.trainer.models`` decoder (``export_hf()``); ``engine``: the colocated rollout engine;
    ``device``: the trainer's. How a push travels depends on the engine (``mode``):

    * ``shared`` (``share_weights``, the synchronous loop: the trainer never writes its weights while the engine
      generates): the embedded engine's parameters are views of the trainer's flat compute buffer — mapped over
      CUDA IPC (shared memory on the CPU) by the engine process, the same tensors' memory in-process — so a push
      moves no bytes and the engine keeps no copy of its own. The process checksums the shared buffers in place
      (sampled rows, all with --check-weights) against the trainer's; in-process, every engine parameter's
      address is checked to be the trainer's tensor's. Where the export does not live in flat storage, or with
      ``--offload-train`` (its compute weights are paused while the engine generates), or ``REDLINE_SYNC_SHARE=0``:
    * ``pipelined`` / ``zero-copy``: an engine in its own process (``EmbeddedEngineProcess.weight_sender``):
      ``redline.sync.protocol`` over CUDA IPC (shared memory on the CPU), staging slots mapped once; zero-copy
      when the export's tensors live in one flat storage per dtype, as the mixed-precision trainer's compute
      buffers do: the plan is then ranges of those storages (``redline.sync.zero_copy``), mapped once by the
      engine, nothing packed (``zero_copy=False``, or None with ``REDLINE_SYNC_ZERO_COPY=0``: pipelined);
    * ``direct`` / ``staged``: the in-process embedded engine (``REDLINE_IN_PROCESS_SYNC``; default staged on a GPU):
      the engine copies the export itself and the result is compared, or pack + fused load with checksums
      (``redline.sync.local``);
    * ``sglang``: SGLang's ``/update_weights_from_tensor`` (the engine packs bucket k+1 while the server loads
      bucket k). Servers that load through redline's checked loader (those redline launches:
      ``redline.rollout.sglang.checked_load``) checksum their parameters after each load, sampled rows (all
      with --check-weights), against the checksum the trainer took while packing; others are checked after
      the push by their ``/weights_checker`` hashes of every parameter;
    * ``sglang-tp``: an SGLang engine of several GPUs colocated with the trainer ranks on them (``seat``, from
      ``redline.loop.engine_placement``): every rank of the seat packs each bucket on its own GPU and the
      payloads are gathered to the seat's leader, which sends slime's per-rank list in one request
      (``redline.sync.sglang.gathered_buckets``); only the leader releases and resumes the engine's memory, and
      the seat's ranks wait for each other around it. Not checked: ``/weights_checker`` hashes TP shards;
    * ``unchecked``: any other engine's ``update_weights``.

    ``check_weights`` (--check-weights): every row of every bucket is checked; otherwise every
    ``SAMPLED_ROW_STRIDE``-th row (and each bucket's last). A mismatch raises ``ChecksumMismatch`` (SGLang:
    ``WeightsMismatch``) naming the buckets (parameters). ``timings`` holds the last release's and push's
    phases in seconds under their ``perf/*`` names (the parts of ``redline.loop.metrics.PHASE_PARTS``), and
    ``perf/trainer_paused_bytes`` where the trainer was paused (or, engine offloaded, only made room) and
    ``perf/kv_headroom_bytes``, the GPU's free memory as the engine takes its KV cache back.
    ``train_offload``: the trainer's ``TrainOffload`` with ``--offload-train`` (see the module docstring).
    """

    def __init__(self, model, engine, *, bucket_bytes: int, offload: bool, device: torch.device | str = "cpu",
                 check_weights: bool = False, zero_copy: bool | None = None, seat=None, train_offload=None,
                 share_weights: bool = False, offload_tags: frozenset[str] = MEMORY_TAGS):
        self.model, self.engine, self.offload, self.seat = model, engine, offload, seat
        self.offload_tags = offload_tags  # what --offload-rollout releases (--offload-rollout-level)
        self.train = train_offload  # redline.loop.train_offload.TrainOffload (--offload-train) or None
        if train_offload is not None:
            zero_copy = share_weights = False  # pausable memory cannot be exported over CUDA IPC
        share_weights = share_weights and env_switch(SHARE_ENV)
        # the rank that makes the engine's memory calls: a seat's leader, or the only user of its own engine
        self.controls_engine = seat is None or seat.is_leader
        self.device = torch.device(device)
        self.plan: WeightPlan = plan_for(model.export_hf(), bucket_bytes)
        self.released = False
        self.engine_bytes = 0  # bytes the engine released to the driver at its last release
        self.row_stride = 1 if check_weights else SAMPLED_ROW_STRIDE
        self.timings: dict[str, float] = {}
        self.sender = self.local = self.flat = self.targets = None
        if hasattr(engine, "weight_sender"):
            if zero_copy is None:
                zero_copy = env_switch(ZERO_COPY_ENV)
            self._plan_in_place(bucket_bytes, zero_copy)
            self.sender = engine.weight_sender(self.plan, self.device, checksum_row_stride=self.row_stride)
            self.mode = "pipelined" if self.flat is None else "shared" if share_weights else "zero-copy"
        elif hasattr(engine, "loading_weights"):
            from redline.rollout.embedded.colocated import EngineTargets
            from redline.sync.local import LocalSender

            self.targets = EngineTargets(engine)
            if self._plan_in_place(bucket_bytes, share_weights):
                self.mode = "shared"
            else:
                self.mode = in_process_mode(self.device)
                self.local = LocalSender(self.plan, self.targets, self.device, checksum_row_stride=self.row_stride)
        elif seat is not None:
            self.mode = "sglang-tp"
        else:
            self.mode = "sglang" if hasattr(engine, "verify_weights") else "unchecked"
            if self.mode == "sglang":
                engine.checksum_row_stride = self.row_stride

    async def release(self) -> None:
        """After a rollout: with ``--offload-rollout``, free the engine's ``offload_tags`` (weights, KV cache) for
        training (``perf/release_time``)."""
        self.timings = {}
        if self.offload and self.seat is not None:  # the engine is idle only once every rank of the seat is
            await asyncio.to_thread(_barrier, self.seat.group)
        if self.offload and not self.released and self.controls_engine:
            free_before = device_memory(self.device)[0]
            await self._timed("perf/release_time", self.engine.release_memory(set(self.offload_tags)))
            # what the engine gave back to the driver, and takes again on resume (an in-process engine returns its
            # memory to the shared caching allocator instead: 0 here)
            self.engine_bytes = device_memory(self.device)[0] - free_before
            self.released = True
        await self.resume_train()

    async def resume_train(self) -> None:
        """``--offload-train``: the trainer's paused state back before it trains or takes log-probs
        (``perf/resume_train_time``)."""
        if self.train is not None and self.train.paused:
            await self._timed("perf/resume_train_time", self._run(self.train.resume))
            self.timings.update(self.train.timings)  # its parts: mapping back, the rebuild

    async def _make_room(self) -> None:
        """Give the trainer's cached, unused blocks back to the driver only when the engine's memory would not
        fit beside them (``make_room``)."""
        if self.device.type == "cuda":
            make_room(self.device, self.engine_bytes + CACHE_HEADROOM)

    async def push(self, version: str) -> None:
        """Send the model's current weights to the engine as ``version`` and check them, taking back released
        memory around the update (weights first, KV cache after)."""
        handled = getattr(self.engine, "handling_seconds", None) if self.controls_engine else None
        if self.train is not None:
            await self.resume_train()  # paused without the rollout's release between (a restarted engine)
            # the trainer's cached blocks go back to the driver only when the engine's memory would not fit beside
            room = self.engine_bytes + CACHE_HEADROOM if self.engine_bytes else None
            await self._timed("perf/pause_train_time", self._run(lambda: self.train.pause_state(room)))
        elif self.released:
            await self._timed("perf/pause_train_time", self._make_room())
            if self.device.type == "cuda":
                self.timings["perf/trainer_paused_bytes"] = torch.cuda.memory_reserved(self.device)
        weights_bytes = 0  # what the engine's weights took back: the rest of engine_bytes is its KV cache
        if self.released and "weights" in self.offload_tags:
            free_before = device_memory(self.device)[0]
            await self._timed("perf/resume_weights_time", self.engine.resume_memory({"weights"}))
            weights_bytes = free_before - device_memory(self.device)[0]
        before_sync = self.engine.handling_seconds if handled is not None else None
        await self._timed("perf/sync_time", self._sync(version))
        if handled is not None:
            self.timings["perf/sync_sglang_time"] = self.engine.handling_seconds - before_sync
        if self.mode == "sglang" and not self.engine.last_push_checked:
            await self._timed("perf/check_weights_time", self.engine.verify_weights(self.model.export_hf()))
        if self.train is not None:  # the compute weights last: the push and its check read them
            state_seconds = self.timings["perf/pause_train_time"]
            await self._timed("perf/pause_train_time", self._run(self.train.pause_weights))
            self.timings["perf/pause_train_time"] += state_seconds
            self.timings["perf/trainer_paused_bytes"] = self.train.residual_bytes()
            self.timings.update(self.train.timings)  # each group's pause (perf/pause_train_<group>_time)
        if self.released:
            if self.device.type == "cuda":
                # the push's own buffers came out of the room the pause left: the KV cache must still fit
                make_room(self.device, self.engine_bytes - weights_bytes + CACHE_HEADROOM)
                # free memory as the KV cache comes back: what a cache sized by it gets
                self.timings["perf/kv_headroom_bytes"] = device_memory(self.device)[0]
            if "kv_cache" in self.offload_tags:
                await self._timed("perf/resume_kv_time", self.engine.resume_memory({"kv_cache"}))
            self.released = False
        if handled is not None:
            self.timings["perf/update_weights_sglang_time"] = self.engine.handling_seconds - handled
        if self.seat is not None:
            # waits for the leader's update (and cache resume): the server let go of every rank's payload, and no
            # rank generates before the engine has its KV cache back
            await asyncio.to_thread(self._take_leaders_timings)
            if self.device.type == "cuda":
                torch.cuda.ipc_collect()

    def _plan_in_place(self, bucket_bytes: int, wanted: bool) -> bool:
        """Plan the buckets as ranges of the trainer's flat storages (``redline.sync.zero_copy``) when ``wanted``
        and the export lives in such storage; whether it did."""
        in_place = plan_in_place(self.model.export_hf(), bucket_bytes) if wanted else None
        if in_place is not None:
            self.plan, self.flat = in_place
            # zero-copy / shared read the parameters' storage as it was planned: checked at every push (cheap)
            self._homes = [(p, _offset(p)) for p in self.model.parameters() if _base(p) in self._flat_bases()]
        return in_place is not None

    def _check_in_place(self) -> None:
        bases = self._flat_bases()  # addresses, not identities: shared memory moves a CPU storage once
        moved = [p for p, home in self._homes if _base(p) not in bases or _offset(p) != home]
        if moved:
            raise SyncError(f"{self.mode} weight sync: {len(moved)} parameter(s) no longer live in the storage the "
                            "plan was made over (was a parameter's .data replaced?); build the WeightSync again, "
                            f"or set {ZERO_COPY_ENV}=0 / {SHARE_ENV}=0")

    async def _sync(self, version: str) -> None:
        if self.flat is not None:
            self._check_in_place()
        if self.sender is not None:  # the engine's own process; blocks this thread, nothing else runs meanwhile
            with device_scope(self.device):
                if self.flat is not None:
                    self.sender.sync_flat(self.flat, version=str(version), share=self.mode == "shared")
                else:
                    self.sender.sync(self.model.export_hf(), version=str(version))
        elif self.mode == "shared":  # the in-process engine: its parameters are (made) the trainer's tensors
            reason = self.targets.share(self.flat, self.plan)
            if reason is not None:
                raise SyncError(f"shared weight sync: the in-process engine cannot use the trainer's weights in "
                                f"place: {reason}; {SHARE_ENV}=0 gives it its own copy")
            await self.engine.update_weights([], version)  # no buckets: publishes the version
        elif self.mode == "staged":
            with device_scope(self.device):
                self.local.sync(self.model.export_hf())
            await self.engine.update_weights([], version)  # no buckets: publishes the version
        elif self.mode == "sglang-tp":
            from redline.sync.sglang import gathered_buckets

            buckets = gathered_buckets(self._seat_buckets(), self._serialize_own, self.seat.group,
                                       list(self.seat.ranks))
            if self.seat.is_leader:
                await self.engine.update_weights(buckets, version=version)
            else:
                async for _ in buckets:  # this rank's payloads go to the leader
                    pass
                if self.engine is not None:  # a client of the leader's server (this rank generates too)
                    self.engine.weight_version = str(version)
        else:
            await self.engine.update_weights(named_buckets(self.plan, self.model.export_hf()), version=version)
            if self.mode == "direct":
                with device_scope(self.device):
                    self.local.check_copies(self.model.export_hf())

    def _take_leaders_timings(self) -> None:
        """Collective over the seat, after the leader's push: every rank reports the engine's phases as the leader
        timed them (its own where it has them), so all ranks' metrics have the same keys (the data-parallel
        reduction needs it)."""
        import torch.distributed as dist

        box = [self.timings if self.seat.is_leader else None]
        dist.broadcast_object_list(box, src=self.seat.leader, group=self.seat.group)
        for key, value in box[0].items():
            self.timings.setdefault(key, value)

    def _seat_buckets(self):
        """What this rank of an engine seat hands its engine TP rank, one list of ``(hf_name, full tensor)`` a
        request: the plan's buckets of the export (a TP/PP trainer's group: ``ModelParallelWeightSync``)."""
        return named_buckets(self.plan, self.model.export_hf())

    def _serialize_own(self, bucket) -> str:
        """This rank's payload of one bucket: CUDA-IPC handles into a fresh flattened buffer on its GPU."""
        from redline.rollout.sglang.payload import serialize_bucket

        with device_scope(self.device):
            return serialize_bucket(bucket).per_rank[0]

    async def _run(self, fn) -> None:
        with device_scope(self.device):
            fn()

    def _flat_bases(self) -> set[int]:
        return {flat.untyped_storage().data_ptr() for flat in self.flat}

    async def _timed(self, metric: str, work) -> None:
        start = _clock(self.device)
        await work
        self.timings[metric] = _clock(self.device) - start

    async def close(self) -> None:
        """Give back the staging memory and the engine process's mappings (the engine's shutdown closes its
        weight channel)."""
        if self.sender is not None:
            try:
                self.sender.release()
            except SyncError:  # the engine process is gone: its exit unmapped everything (and a run's own error wins)
                running = getattr(self.engine, "running", None)
                if running is not None and running():  # it is not: it may still read our (shared) buffers
                    raise
            self.sender = None
        if self.local is not None:
            self.local.release()

    def _sglang_check(self, rows: str) -> str:
        """How a push into SGLang servers (mode ``sglang``) is checked: in their load where they run redline's
        loader (``SGLangEngine.checked_loads``: True, or None until the first push asks), else by
        ``/weights_checker``."""
        in_load = f"the servers' parameters checksummed as each bucket loads, {rows}"
        hashes = "SGLang /weights_checker hashes after each push"
        loaded = self.engine.checked_loads
        return in_load if loaded else hashes if loaded is False else (
            f"{in_load} where the servers load through redline's loader (asked at the first push), else {hashes}")

    def describe(self) -> str:
        rows = "every row" if self.row_stride == 1 else f"every {self.row_stride}th row (--check-weights: all)"
        check = self._sglang_check(rows) if self.mode == "sglang" else {
                 "sglang-tp": f"no check (SGLang's /weights_checker hashes its TP shards; engine TP "
                              f"{len(self.seat.ranks) if self.seat else 1}, this rank its TP rank "
                              f"{self.seat.engine_rank if self.seat else 0})",
                 "unchecked": "no check (this engine offers none)",
                 "direct": f"sent vs held bytes, {rows}",
                 "shared": "the engine reads the trainer's compute buffer in place, " + (
                     f"checksummed there, {rows}" if self.sender is not None else
                     "its parameters' addresses checked to be the trainer's tensors"),
                 }.get(self.mode, f"bucket checksums, {rows}")
        train = ""
        if self.train is not None:
            plan = self.train.plan or self.train.make_plan()  # the pause's own plan while paused
            train = (f" · offload train: {plan.device_bytes / 2**30:.2f} GiB released while the engine generates, "
                     f"{plan.host_bytes / 2**30:.2f} GiB of it kept in pinned host memory")
        offload = ""
        if self.offload:
            kept = {"weights": "its weights", "kv_cache": "its KV cache"}
            offload = " · offload rollout" + "".join(f" (the engine keeps {kept[t]})" for t in
                                                     sorted(MEMORY_TAGS - self.offload_tags))
        return f"weight sync: {self.mode}, {describe_plan(self.plan)}{offload} · {check}{train}"


OFFLOAD_LEVELS = {"kv_cache": "kv_cache", "weight": "weights"}  # --offload-rollout-level value -> memory tag


def offload_tags(level: list[str]) -> frozenset[str]:
    """The engine memory tags ``--offload-rollout-level`` releases (``validate.check_offload_level`` has checked
    its values)."""
    return frozenset(OFFLOAD_LEVELS[value] for value in level)


class BroadcastWeightSync:
    """``--no-colocate``: the same plan, broadcast from this process (group rank 0) to every engine GPU.

    ``engines``: engines on their own devices — ``EmbeddedEngineProcess`` objects or ``SGLangEngine`` s, each
    joining with its ``weight_group_size`` GPUs at consecutive ranks from 1 on; ``device``: the trainer's
    (``cuda:0`` or ``cpu``). ``verify`` (--check-sglang-weights): after each push, every engine with a
    ``verify_weights`` compares the hashes of what it holds with the trainer's tensors. Call ``connect()``
    once before the first ``push``. Every wait (group setup, each push) is bounded by ``timeout_s``: a dead or
    stuck engine fails the run instead of hanging it.
    """

    def __init__(self, model, engines, *, bucket_bytes: int, device: torch.device, timeout_s: float,
                 verify: bool = False):
        self.model, self.engines, self.device = model, list(engines), torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self.plan: WeightPlan = plan_for(model.export_hf(), bucket_bytes)
        # the group's checksum comparison is a collective: it runs only when every receiver takes part
        self.compare_checksums = all(e.joins_checksum_comparison for e in self.engines)
        self.verifiers = [e.verify_weights for e in self.engines if verify and hasattr(e, "verify_weights")]
        self.sender = None
        self.group = None
        self.timings: dict[str, float] = {}  # the last push's perf/sync_time and perf/check_weights_time

    async def connect(self) -> None:
        """Build the weight-update group: this process as rank 0, the engines at the same time as 1..N."""
        from redline.loop.ray_engines import weight_group_address
        from redline.sync.broadcast import (
            BroadcastSender,
            init_weight_update_group,
            rank_offsets,
            stage_group_name,
        )

        # this host's loopback, or under Ray this node's IP (the engines' actors may be on other nodes); the port
        # was free here a moment ago
        address, port = weight_group_address(), free_port()
        offsets, world = rank_offsets([e.weight_group_size for e in self.engines])
        name = f"{stage_group_name(0)}-{port}"  # unique in this process, also when an earlier run left its group

        def join():
            with device_scope(self.device):
                return init_weight_update_group(address, port, 0, world, name, backend=self.backend,
                                                timeout=timedelta(seconds=self.timeout_s))

        joins = [engine.join_weight_group(address, port, rank, world, name, self.backend, self.plan, self.timeout_s)
                 for engine, rank in zip(self.engines, offsets)]
        self.group, *_ = await self._bounded(asyncio.to_thread(join), *joins, what="building the weight-update group")
        self.sender = BroadcastSender(self.group, self.plan, self.device, verify=self.compare_checksums)

    async def release(self) -> None:
        """Nothing to free: the engines have their own devices."""
        self.timings = {}

    async def push(self, version: str) -> None:
        """Broadcast every bucket while the engines receive them; each bucket's layout is announced to the
        engines (``receive_weights``' ``announced``) just before its broadcast starts."""
        if self.sender is None:
            raise RuntimeError("BroadcastWeightSync.push before connect()")
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in self.engines]

        def announce(layout) -> None:  # on the sending thread
            for queue in queues:
                loop.call_soon_threadsafe(queue.put_nowait, layout)

        def send():
            try:
                with device_scope(self.device):
                    self.sender.sync(self.model.export_hf(), announce=announce)
            finally:
                announce(None)  # the end of the announcements, also when the broadcast failed

        start = _clock(self.device)
        await self._bounded(asyncio.to_thread(send),
                            *(e.receive_weights(version, _announced(q)) for e, q in zip(self.engines, queues)),
                            what=f"the weight broadcast of version {version}")
        checked = _clock(self.device)
        self.timings["perf/sync_time"] = checked - start
        for verify in self.verifiers:
            await verify(self.model.export_hf())
        if self.verifiers:
            self.timings["perf/check_weights_time"] = _clock(self.device) - checked

    async def close(self) -> None:
        """Leave the group on every side (before the engines shut down)."""
        if self.group is None:
            return
        # every side at once: NCCL's communicator teardown may wait for the peers, so the trainer must not wait
        # for the engines to finish leaving before it starts to leave itself
        await self._bounded(*(e.leave_weight_group() for e in self.engines),
                            asyncio.to_thread(self._destroy_group),
                            what="leaving the weight-update group")
        self.group = self.sender = None

    def _destroy_group(self) -> None:
        import torch.distributed as dist

        with device_scope(self.device):
            dist.destroy_process_group(self.group)

    def describe(self) -> str:
        gpus = sum(e.weight_group_size for e in self.engines)
        check = "bucket checksums" if self.compare_checksums else (
            "server hashes" if self.verifiers else "no check (--check-sglang-weights adds one)")
        return (f"weight sync: broadcast ({self.backend}) {self.device} → {len(self.engines)} engine(s) on {gpus} "
                f"device(s), {describe_plan(self.plan)} · {check}")

    async def _bounded(self, *awaitables, what: str):
        try:
            return await asyncio.wait_for(asyncio.gather(*awaitables), self.timeout_s + 30)
        except TimeoutError:
            raise TimeoutError(f"{what}: no answer from every side within {self.timeout_s + 30:.0f} s "
                               f"(--distributed-timeout-minutes); an engine process may have died") from None


def _barrier(group) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


async def _announced(queue: asyncio.Queue):
    """The layouts put on ``queue`` until ``None``."""
    while (layout := await queue.get()) is not None:
        yield layout
