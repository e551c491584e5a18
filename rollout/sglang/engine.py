"""SGLang as a rollout engine: one or more servers (launched here or attached by address), generation routed
through sglang-router when one runs, else to the least-loaded server; control calls go to every server.

Memory tags map onto SGLang's: "weights" → ``weights``; "kv_cache" → ``kv_cache`` and ``cuda_graph`` (the
graphs are sized with the cache, and slime resumes them together after the weights).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from redline.devices import current_device, on_device
from redline.rollout.engine import (
    SerializedBucket,
    WeightBuckets,
    check_tags,
    iterate_buckets,
)
from redline.rollout.sglang.client import SGLangClient
from redline.rollout.sglang.checked_load import LOADER
from redline.rollout.sglang.payload import CheckedPacker, serialize_bucket
from redline.rollout.sglang.server import ManagedProcess, launch_router, launch_servers
from redline.rollout.sglang.weight_check import compare_checksums, expected_checksums
from redline.rollout.types import FinishReason, GenerateRequest, GenerateResult
from redline.sync.sglang import update_from_distributed_body

SGLANG_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}

_logger = logging.getLogger(__name__)


class SGLangEngine:
    """Implements ``redline.rollout.engine.Engine`` over SGLang servers at ``worker_urls``.

    ``router_url``: an sglang-router in front of the workers; without one each request goes to the worker with
    the fewest requests in flight from this client. ``owned`` processes are stopped by ``shutdown``.
    ``tp_size``: GPUs per server, the number of payloads a ``SerializedBucket`` must carry.
    ``handling_seconds``: wall seconds spent waiting on the servers' answers to control calls (weight updates,
    memory release and resume, ``/weights_checker``; all servers at once count once), summed since the engine was
    made: SGLang's own handling, read before and after a phase to tell it from the caller's work.
    ``checked_loads``: whether the servers load through redline's checked loader (``checked_load``; True for
    servers launched here with TP = 1, None: asked of each server at the first push); ``checksum_row_stride``:
    the rows that check reads (1: all; the loop sets it from ``--check-weights``). ``last_push_checked``: the
    last ``update_weights`` checked every server's parameters itself, so no ``verify_weights`` is needed.
    """

    def __init__(self, worker_urls: list[str], *, router_url: str | None = None, tp_size: int = 1,
                 owned: list[ManagedProcess] = (), weight_version: str = "0", checked_loads: bool | None = None):
        if not worker_urls:
            raise ValueError("SGLangEngine needs at least one worker url")
        self.workers = [SGLangClient(u) for u in worker_urls]
        self.router = SGLangClient(router_url) if router_url else None
        self.tp_size = tp_size
        self.owned = list(owned)
        self.weight_version = weight_version
        self._paused = False
        self._weight_group: str | None = None
        self.handling_seconds = 0.0
        self.checked_loads = checked_loads if tp_size == 1 else False
        self.checksum_row_stride = 1
        self.last_push_checked = False

    # Disaggregated sync (``redline.loop.weight_sync.BroadcastWeightSync``): the GPUs this engine joins the
    # trainer's weight-update group with, and whether they take part in redline's bucket-checksum comparison
    # (SGLang's receive path has no such step; ``verify_weights`` checks the result instead).
    @property
    def weight_group_size(self) -> int:
        return len(self.workers) * self.tp_size

    joins_checksum_comparison = False

    def endpoints(self) -> dict:
        """What another process needs to generate on these servers itself: ``SGLangEngine(**endpoints())`` there
        is a client of the same workers and router, owning no process (the rollout manager actor under Ray,
        ``redline.loop.ray_rollout``)."""
        return {"worker_urls": [w.url for w in self.workers], "router_url": self.router.url if self.router else None,
                "tp_size": self.tp_size}

    @classmethod
    def launch(cls, model_path, *, num_engines: int = 1, tp_size: int = 1, sglang_args: list[str] = (),
               use_router: bool | None = None, base_gpu_ids: list[int] | None = None, log_dir="logs",
               **server_kwargs) -> SGLangEngine:
        """Start ``num_engines`` servers, by default on consecutive GPU groups of ``tp_size`` GPUs
        (``base_gpu_ids`` overrides, e.g. ``[0, 0]`` for two small servers sharing one GPU), plus sglang-router
        when there are several and it is installed (``use_router=None``) or when asked (``True``). Servers on
        disjoint GPUs start concurrently (``launch_servers``)."""
        from redline.extras import available

        base_gpu_ids = base_gpu_ids if base_gpu_ids is not None else [i * tp_size for i in range(num_engines)]
        if len(base_gpu_ids) != num_engines:
            raise ValueError(f"base_gpu_ids has {len(base_gpu_ids)} entries for num_engines={num_engines}")
        servers = launch_servers(model_path, base_gpu_ids, tp_size=tp_size, extra_args=list(sglang_args),
                                 log_dir=log_dir, weight_loaders=[LOADER] if tp_size == 1 else [], **server_kwargs)
        urls = [s.url for s in servers]
        if use_router is None:
            use_router = num_engines > 1 and available("sglang_router")
        try:
            router = launch_router(urls, log_dir=log_dir) if use_router else None
        except BaseException:
            for s in servers:
                s.stop()
            raise
        owned = servers + ([router] if router else [])
        return cls(urls, router_url=router.url if router else None, tp_size=tp_size, owned=owned,
                   checked_loads=tp_size == 1)

    async def _generate_one(self, request: GenerateRequest) -> GenerateResult:
        if self._paused:  # the servers abort what they hold; what arrives while paused is not sent at all
            return GenerateResult([], [], FinishReason.ABORT, self.weight_version)
        # Picked and counted before the first await, so concurrent calls see each other's load.
        client = self.router or min(self.workers, key=lambda w: w.in_flight)
        client.in_flight += 1
        try:
            return await client.generate(request, self.weight_version)
        finally:
            client.in_flight -= 1

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """One ``/generate`` call per request, all concurrent (the servers batch them)."""
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def _all(self, method: str, *args) -> list:
        """``method`` on every server at once; its wall time counts in ``handling_seconds``."""
        return await self._each(method, [args] * len(self.workers))

    async def _each(self, method: str, args_per_server: list[tuple]) -> list:
        """``method`` on every server at once, server i with ``args_per_server[i]``; timed as ``_all``."""
        start = time.perf_counter()
        try:
            return await asyncio.gather(*(getattr(w, method)(*args) for w, args in zip(self.workers,
                                                                                       args_per_server)))
        finally:
            self.handling_seconds += time.perf_counter() - start

    async def update_weights(self, buckets: WeightBuckets, version: str) -> None:
        """Send every bucket to every server (opening/closing an update session on >= 0.5.21), then flush
        caches and publish ``version``. Named-tensor buckets are serialized here (CUDA IPC, same host), each
        while the servers still load the one before: one update request in flight at a time (the servers
        take buckets in order), bucket k+1 packed meanwhile. Every bucket gets a fresh buffer: a server answers
        ``flattened_bucket`` before its copies out of the IPC buffer have finished, so only PyTorch's IPC
        refcount (the server's stream synchronised before it lets go, then ``ipc_collect``) may decide when that
        memory is reused. With ``checked_loads`` the servers load through redline's loader, which checksums
        their parameters after the load, and the push raises ``WeightsMismatch`` naming the bucket unless every
        server read back what was packed (``CheckedPacker``; ``last_push_checked`` then says so). A server that
        wrote no result loaded copies of the payloads (it is on another GPU): the push is left to
        ``verify_weights`` and later ones go as flattened buckets."""
        self.last_push_checked = False
        checker = CheckedPacker(current_device(), self.checksum_row_stride, [w.url for w in self.workers]) \
            if await self._loads_checked() else None
        await self._all("begin_weight_update")
        in_flight = None  # the update request of the previous bucket
        buckets_sent = 0
        try:
            async for bucket in iterate_buckets(buckets):
                buckets_sent += 1
                if checker is not None and not isinstance(bucket, SerializedBucket):
                    payloads = await asyncio.to_thread(on_device, current_device(), checker.pack, list(bucket))
                    request = self._each("update_weights_from_tensor", [((p,), LOADER, str(version))
                                                                        for p in payloads])
                else:
                    if not isinstance(bucket, SerializedBucket):
                        bucket = await asyncio.to_thread(on_device, current_device(), serialize_bucket,
                                                         list(bucket), self.tp_size)
                    if len(bucket.per_rank) != self.tp_size:
                        raise ValueError(f"bucket carries {len(bucket.per_rank)} payloads; the servers have "
                                         f"tp_size={self.tp_size}")
                    request = self._all("update_weights_from_tensor", bucket.per_rank, bucket.load_format,
                                        str(version))
                if in_flight is not None:
                    await in_flight
                    if checker is not None:
                        checker.collect(unanswered=1)  # all but the bucket just packed were answered
                in_flight = asyncio.ensure_future(request)
            if in_flight is not None:
                await in_flight
        finally:
            if in_flight is not None and not in_flight.done():  # a failure while packing: no request left behind
                in_flight.cancel()
        if checker is not None:
            silent = await asyncio.to_thread(on_device, current_device(), checker.verify)
            if silent:  # they loaded copies of the payloads: this push is checked by /weights_checker, later
                # ones go as flattened buckets
                _logger.warning("SGLang servers %s wrote no checked-load results into the trainer's buffers (on "
                                "another GPU?): checking their weights with /weights_checker instead", silent)
                self.checked_loads = False
            self.last_push_checked = not silent and 0 < len(checker.packed) == buckets_sent
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # let the allocator reuse bucket memory the servers have let go of
        await self._all("end_weight_update")
        self.weight_version = str(version)

    async def _loads_checked(self) -> bool:
        """Whether every server loads through redline's checked loader (asked once where not known)."""
        if self.checked_loads is None:
            loaders = await asyncio.gather(*(w.weight_loaders() for w in self.workers))
            self.checked_loads = all(LOADER in names for names in loaders)
        return self.checked_loads

    async def join_weight_group(self, master_address: str, master_port: int, rank: int, world_size: int,
                                group_name: str, backend: str, plan=None, timeout_s: float | None = None) -> None:
        """Every server joins the trainer's weight-update group, server i's TP ranks from ``rank + i·tp_size``
        on; returns once the group is built (the trainer joins as rank 0 at the same time). ``plan`` and
        ``timeout_s`` are for engines that post their receives themselves; SGLang gets each bucket announced
        (``receive_weights``) and the caller bounds the waits."""
        await asyncio.gather(*(w.init_weights_update_group(master_address, master_port, rank + i * self.tp_size,
                                                           world_size, group_name, backend)
                               for i, w in enumerate(self.workers)))
        self._weight_group = group_name

    async def receive_weights(self, version: str, announced) -> None:
        """Load what the trainer broadcasts: for each bucket layout ``announced`` (an async iterator) yields, in
        broadcast order, every server gets its ``/update_weights_from_distributed`` request (it posts the
        receive, then loads); the next bucket is announced once all have answered, so no server can post its
        receives out of order. Opens/closes the update session on >= 0.5.21, flushes caches, publishes
        ``version``."""
        if self._weight_group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        await self._all("begin_weight_update")
        async for layout in announced:
            await self._all("update_weights_from_distributed",
                            update_from_distributed_body(layout, group_name=self._weight_group,
                                                         weight_version=str(version)))
        await self._all("end_weight_update")
        self.weight_version = str(version)

    async def leave_weight_group(self) -> None:
        if self._weight_group is not None:
            await self._all("destroy_weights_update_group", self._weight_group)
            self._weight_group = None

    async def verify_weights(self, named_tensors, hash_fn=None) -> None:
        """Raise ``WeightsMismatch`` unless every server holds exactly ``named_tensors`` (HF names, the tensors
        last sent), compared through SGLang's ``/weights_checker`` hashes (``weight_check``). TP = 1 servers. The
        expected hashes are computed here while the servers hash theirs: ``named_tensors`` is consumed in a worker
        thread on the caller's GPU, streamed (a generator gathering a model-parallel export holds one fused
        parameter at a time, as ``sglang_parameters`` does)."""
        if self.tp_size != 1:
            raise ValueError(f"verify_weights compares whole tensors; the servers have tp_size={self.tp_size}")
        answers = asyncio.ensure_future(self._all("weight_checksums"))
        try:
            expected = await asyncio.to_thread(on_device, current_device(), expected_checksums, named_tensors,
                                               hash_fn)
        except BaseException:
            answers.cancel()
            raise
        for worker, answer in zip(self.workers, await answers):
            compare_checksums(expected, answer, worker.url)

    async def release_memory(self, tags) -> None:
        await self._all("release_memory", [t for tag in sorted(check_tags(tags)) for t in SGLANG_TAGS[tag]])

    async def resume_memory(self, tags) -> None:
        # weights before the cache: the two-stage resume around a sync calls this twice, but one call with both
        # tags must keep the order too.
        for tag in ("weights", "kv_cache"):
            if tag in check_tags(tags):
                await self._all("resume_memory", SGLANG_TAGS[tag])

    async def flush_cache(self) -> None:
        await self._all("flush_cache")

    async def pause(self) -> None:
        self._paused = True
        await self._all("pause")

    async def resume(self) -> None:
        await self._all("resume")
        self._paused = False

    async def freeze_gc(self) -> list[str]:
        """``SGLangClient.freeze_gc`` on every server (not the router, which holds no model); the URLs of those
        without the route."""
        frozen = await self._all("freeze_gc")
        return [worker.url for worker, done in zip(self.workers, frozen) if not done]

    async def health(self) -> bool:
        checks = await asyncio.gather(*(w.health() for w in self.workers))
        return all(checks)

    async def shutdown(self) -> None:
        for client in self.workers + ([self.router] if self.router else []):
            await client.close()
        for process in reversed(self.owned):
            await asyncio.to_thread(process.stop)
        self.owned.clear()

