"""The trainer → engine weight push of the RL loop, through ``redline.sync``'s bucket plan.

The plan (``redline.sync.plan.plan_for``) is made once from the model's HF-named export: dtype-homogeneous
buckets of at most ``--update-weight-buffer-size`` bytes, a layer's tensors never split. Each sync streams the
export through it (``named_buckets``) into ``engine.update_weights``: the embedded engine copies each bucket
into its fused tensors, the embedded engine process receives it by shared memory / CUDA IPC, SGLang gets one
``FlattenedTensorBucket`` payload per bucket (serialized by ``SGLangEngine``); with ``--check-sglang-weights``
the servers' hashes of their parameters must then equal those of the sent tensors (``verify_weights``).

With ``--offload-rollout`` the engine gives its memory back after each rollout and the push follows the
colocated sequence of ``redline.rollout.engine``: ``resume_memory({"weights"})`` → ``update_weights`` →
``resume_memory({"kv_cache"})``, so the new weights land before the KV cache competes for memory.

With ``--no-colocate`` (``BroadcastWeightSync``) the engines run on other GPUs (embedded engine processes also on
the CPU of a CPU machine): the trainer is rank 0 of a ``redline.sync.broadcast`` weight-update group, built the way
SGLang builds it, and the engines' GPUs the next ranks; every push broadcasts the plan's buckets (NCCL on GPUs,
gloo on the CPU) while the engines receive and load them. Embedded engine processes post their receives from the
plan and the push ends with the group's checksum comparison (a mismatch raises ``ChecksumMismatch``); SGLang
servers get each bucket announced by ``/update_weights_from_distributed`` just before its broadcast, and with
``--check-sglang-weights`` their parameter hashes are compared afterwards, as on the colocated path.
"""

import asyncio
from datetime import timedelta

import torch

from redline.devices import device_scope
from redline.ports import free_port
from redline.sync.plan import WeightPlan, named_buckets, plan_for


def describe_plan(plan: WeightPlan) -> str:
    sizes = [b.nbytes for b in plan.buckets]
    return f"{len(sizes)} buckets, {plan.nbytes / 2**20:.1f} MiB (largest {max(sizes) / 2**20:.1f} MiB)"


class WeightSync:
    """Owns the bucket plan and the engine's memory state between rollouts.

    ``model``: a ``redline.trainer.models`` decoder (``export_hf()``); ``engine``: any rollout engine.
    """

    def __init__(self, model, engine, *, bucket_bytes: int, offload: bool, verify: bool = False):
        self.model, self.engine, self.offload = model, engine, offload
        self.plan: WeightPlan = plan_for(model.export_hf(), bucket_bytes)
        self.released = False
        # ``verify`` (--check-sglang-weights): SGLang offers no per-bucket checksum on its receive path, so a push
        # is checked afterwards against the hashes of what the servers hold (``SGLangEngine.verify_weights``)
        self.verify = engine.verify_weights if verify else None

    async def release(self) -> None:
        """After a rollout: with ``--offload-rollout``, free the engine's weights and KV cache for training."""
        if self.offload and not self.released:
            await self.engine.release_memory({"weights", "kv_cache"})
            self.released = True

    async def push(self, version: str) -> None:
        """Send the model's current weights to the engine as ``version``, taking back released memory around
        the update (weights first, KV cache after)."""
        if self.released:
            if torch.cuda.is_available():
                # blocks the trainer's caching allocator holds but does not use would starve the engine
                torch.cuda.empty_cache()
            await self.engine.resume_memory({"weights"})
        await self.engine.update_weights(named_buckets(self.plan, self.model.export_hf()), version=version)
        if self.verify is not None:
            await self.verify(self.model.export_hf())
        if self.released:
            await self.engine.resume_memory({"kv_cache"})
            self.released = False

    def describe(self) -> str:
        return f"weight sync: {describe_plan(self.plan)}{' · offload rollout' if self.offload else ''}"


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
        self.verifiers = [e.verify_weights for e in self.engines if verify]
        self.sender = None
        self.group = None

    async def connect(self) -> None:
        """Build the weight-update group: this process as rank 0, the engines at the same time as 1..N."""
        from redline.sync.broadcast import BroadcastSender, init_weight_update_group, rank_offsets, stage_group_name

        address, port = "127.0.0.1", free_port()  # the engines run on this host
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

        await self._bounded(asyncio.to_thread(send),
                            *(e.receive_weights(version, _announced(q)) for e, q in zip(self.engines, queues)),
                            what=f"the weight broadcast of version {version}")
        for verify in self.verifiers:
            await verify(self.model.export_hf())

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


async def _announced(queue: asyncio.Queue):
    """The layouts put on ``queue`` until ``None``."""
    while (layout := await queue.get()) is not None:
        yield layout
