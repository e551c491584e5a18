"""The embedded engine in its own process (``torch.multiprocessing``, spawn).

Weights arrive over two paths. The colocated sync of ``redline train`` uses ``weight_sender``: a
``redline.sync.protocol.WeightSender`` on a channel of its own, served in the child by
``redline.rollout.embedded.colocated.serve_weights`` (persistent staging slots mapped once, the trainer packing
bucket k+1 while the engine loads bucket k, checksums on every bucket; CUDA IPC on a GPU, shared memory on the
CPU). The ``Engine`` protocol's ``update_weights`` / ``load_weights`` remain for callers without a plan: each
bucket's tensors are pickled through the request queue (one shared-memory / CUDA-IPC handle per tensor) and each
call returns only after the engine has copied them, so the sender may then reuse its buffers. An engine whose
colocated sync comes from a process other than its parent (``weights_from_elsewhere``: under Ray, the trainer rank
beside the actor hosting it) serves that channel on a socket instead (``weight_sender_at``).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import threading
from multiprocessing.connection import Client, Listener
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from redline.rollout.engine import WeightBuckets, iterate_buckets
from redline.rollout.types import GenerateRequest, GenerateResult

_READY = -1


class EngineProcessDied(RuntimeError):
    """A call that was waiting on an engine process when it was killed (``EmbeddedEngineProcess.kill``)."""


def _encode(message) -> bytes:
    """Pickle with torch's reductions (shared memory / CUDA IPC for tensors) in the caller's thread, so a
    message that cannot cross raises here instead of dying silently in the queue's feeder thread."""
    return bytes(ForkingPickler.dumps(message))


def _reply(replies, call_id, ok, value) -> None:
    try:
        replies.put(_encode((call_id, ok, value)))
    except Exception as exc:  # noqa: BLE001 - an unpicklable result still has to reach the waiting caller
        replies.put(_encode((call_id, False, RuntimeError(f"{type(exc).__name__}: {exc} (sending {value!r})"))))


def accept_once(listener: Listener):
    """The one connection ``listener`` takes (this engine process's weight sender); the listener is closed after
    it, so its socket file goes and a second sender fails at once instead of at its timeout."""
    try:
        return listener.accept()
    finally:
        listener.close()


def _serve(model_path, engine_kwargs, requests, replies, weight_conn) -> None:
    """Child process: host an EmbeddedEngine and answer ``(call_id, method, args)`` messages in order of arrival
    (calls run concurrently, so a ``pause`` can reach a running ``generate``); serve the colocated sync's
    sessions on ``weight_conn`` from a thread of its own, or with ``weight_conn`` None on the first connection to
    a socket of this node (``weight_address``, reported in the ready message)."""
    from redline.rollout.embedded import broadcast
    from redline.rollout.embedded.colocated import serve_weights
    from redline.rollout.embedded.engine import EmbeddedEngine
    from redline.long_lived import freeze_long_lived
    from redline.rollout.embedded.lifeline import die_with_parent

    die_with_parent()  # a SIGKILLed launcher must not leave this process holding the model

    async def main():
        try:
            engine = EmbeddedEngine.from_pretrained(model_path, **engine_kwargs)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            _reply(replies, _READY, False, exc)
            return
        address = None
        if weight_conn is None:
            listener = Listener(family="AF_UNIX", authkey=mp.current_process().authkey)
            address = listener.address
            threading.Thread(target=lambda: serve_weights(engine, accept_once(listener)), daemon=True,
                             name="embedded-engine-weights-accept").start()
        else:
            serve_weights(engine, weight_conn)
        freeze_long_lived()  # the model and libraries, out of the full collections of the requests' garbage
        _reply(replies, _READY, True, address)
        loop = asyncio.get_running_loop()
        calls = set()

        async def answer(call_id, method, args):
            try:
                if method == "load_weights":
                    value = await asyncio.to_thread(engine.load_weights, *args)
                elif method in broadcast.METHODS:  # the disaggregated sync's receiver (NCCL / gloo)
                    value = await asyncio.to_thread(broadcast.handle, engine, method, args)
                elif method == "set_weight_version":
                    engine.weight_version = args[0]
                    value = None
                else:
                    value = await getattr(engine, method)(*args)
                _reply(replies, call_id, True, value)
            except Exception as exc:  # noqa: BLE001 - the caller's error, re-raised in the parent
                _reply(replies, call_id, False, exc)

        while True:
            call_id, method, args = pickle.loads(await loop.run_in_executor(None, requests.get))
            task = asyncio.create_task(answer(call_id, method, args))
            calls.add(task)
            task.add_done_callback(calls.discard)
            if method == "shutdown":
                await task
                return

    asyncio.run(main())


class EmbeddedEngineProcess:
    """Implements ``redline.rollout.engine.Engine``; ``engine_kwargs`` go to ``EmbeddedEngine.from_pretrained``
    in the child (``dtype``, ``device``, ``max_batch_size`` ...). ``weights_from_elsewhere``: the colocated sync
    comes from another process of this node, not from this one: the child serves it on the first connection to
    ``weight_address`` (``weight_sender_at``; this process's ``authkey`` for the connection and, on the CPU, for the
    shared memory handles, so the other process must share it), and ``weight_sender`` is not this object's."""

    def __init__(self, model_path, *, start_timeout: float = 600.0, weights_from_elsewhere: bool = False,
                 **engine_kwargs):
        ctx = mp.get_context("spawn")
        self._requests, self._replies = ctx.Queue(), ctx.Queue()
        self._weight_conn, child_weight_conn = ctx.Pipe() if not weights_from_elsewhere else (None, None)
        self._process = ctx.Process(target=_serve, args=(str(model_path), engine_kwargs, self._requests,
                                                         self._replies, child_weight_conn),
                                    daemon=True, name="embedded-engine")
        self._process.start()
        if child_weight_conn is not None:
            child_weight_conn.close()  # the child's end lives in the child: its exit closes the channel for us
        _, ok, value = pickle.loads(self._replies.get(timeout=start_timeout))
        if not ok:
            self._process.join()
            raise RuntimeError(f"the embedded engine process failed to start: {value!r}") from value
        self.weight_address: str | None = value
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._reader = threading.Thread(target=self._read_replies, daemon=True, name="embedded-engine-replies")
        self._reader.start()
        self._closed = False

    def _read_replies(self) -> None:
        while True:
            message = self._replies.get()
            if message is None:
                return
            call_id, ok, value = pickle.loads(message)
            waiting = self._waiting.pop(call_id, None)
            if waiting is None:  # failed by ``kill`` meanwhile
                continue
            loop, future = waiting

            def resolve(future=future, ok=ok, value=value):
                if future.done():
                    return
                future.set_result(value) if ok else future.set_exception(value)
            loop.call_soon_threadsafe(resolve)

    async def _call(self, method: str, *args):
        if self._closed:
            raise RuntimeError("the embedded engine process is shut down")
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        message = _encode((call_id, method, args))
        future = loop.create_future()
        self._waiting[call_id] = (loop, future)
        self._requests.put(message)
        return await future

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await self._call("generate", requests)

    async def update_weights(self, buckets: WeightBuckets, version: str) -> None:
        async for bucket in iterate_buckets(buckets):
            await self.load_weights(bucket)
        await self._call("set_weight_version", str(version))

    def weight_sender(self, plan, device, *, checksum_row_stride: int = 1, num_slots: int = 2,
                      timeout: float = 300.0):
        """A ``WeightSender`` of ``plan`` into this process's engine, packing on ``device`` (the trainer's: the
        engine's GPU, or the CPU over shared memory). One sender per engine: they share the channel, which
        carries one session at a time. ``checksum_row_stride``: 1 checks every row of every bucket, n every
        n-th (and the last). A sync's ``version`` is published by this process's loader as the sync ends."""
        if self._closed:
            raise RuntimeError("the embedded engine process is shut down")
        if self._weight_conn is None:
            raise RuntimeError("this engine takes its weights from another process (weights_from_elsewhere): "
                               "weight_sender_at(engine.weight_address, ...) there")
        return _sender(self._weight_conn, plan, device, alive=self._process.is_alive, num_slots=num_slots,
                       timeout=timeout, checksum_row_stride=checksum_row_stride)

    async def load_weights(self, named_tensors) -> None:
        """Copy one bucket of HF-named tensors into the child's model; returns once copied."""
        await self._call("load_weights", [(name, tensor.detach()) for name, tensor in named_tensors])

    weight_group_size = 1  # disaggregated sync: the one device this process joins the weight-update group with
    joins_checksum_comparison = True  # its receiver takes part in the group's bucket-checksum comparison

    async def join_weight_group(self, master_address: str, master_port: int, rank: int, world_size: int,
                                group_name: str, backend: str, plan, timeout_s: float) -> None:
        """Disaggregated sync: join the trainer's weight-update group (``redline.sync.broadcast``) as ``rank``;
        returns once the group is built (the trainer joins as rank 0 at the same time)."""
        await self._call("join_weight_group", master_address, master_port, rank, world_size, group_name, backend,
                         plan, timeout_s)

    async def receive_weights(self, version: str, announced=None) -> None:
        """Receive every bucket of the plan from the group's rank 0 (which broadcasts meanwhile), load it, check
        the checksums with the group, then report ``version``. The child posts its receives from the plan it got
        when joining, so the trainer's per-bucket announcements (``announced``) are not needed here."""
        await self._call("receive_weights", str(version))

    async def leave_weight_group(self) -> None:
        await self._call("leave_weight_group")

    async def export_weights(self) -> list:
        """The engine's weights in HF names, copied to the CPU (for checks)."""
        return await self._call("export_weights")

    async def release_memory(self, tags) -> None:
        await self._call("release_memory", set(tags))

    async def resume_memory(self, tags) -> None:
        await self._call("resume_memory", set(tags))

    async def flush_cache(self) -> None:
        await self._call("flush_cache")

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def health(self) -> bool:
        return self.running() and await self._call("health")

    def running(self) -> bool:
        """Whether the process runs and is not shut down: a look at the process, no request (it may still hang)."""
        return self._process.is_alive() and not self._closed

    @property
    def pid(self) -> int:
        """The engine process's id (fault injection SIGKILLs it)."""
        return self._process.pid

    def kill(self) -> None:
        """Stop a dead or hung engine without asking it: SIGKILL the process and fail every call still waiting for
        an answer with ``EngineProcessDied``. Idempotent; the object is shut down after. The reader thread (a daemon)
        is left blocked on the reply queue: a process killed while writing a reply may hold the queue's write lock
        for ever, so nothing can be put there to end it."""
        if self._closed:
            return
        self._closed = True
        self._process.kill()
        self._process.join()
        if self._weight_conn is not None:
            self._weight_conn.close()
        waiting, self._waiting = self._waiting, {}
        for call_id, (loop, future) in waiting.items():
            error = EngineProcessDied(f"the embedded engine process (pid {self._process.pid}) was killed")
            loop.call_soon_threadsafe(lambda f=future, e=error: f.done() or f.set_exception(e))

    async def shutdown(self) -> None:
        if self._closed:
            return
        await self._call("shutdown")
        self._closed = True
        if self._weight_conn is not None:
            self._weight_conn.close()  # ends the child's weight-receiver thread (it is a daemon either way)
        await asyncio.to_thread(self._process.join)
        self._replies.put(None)  # ends the reader thread
        await asyncio.to_thread(self._reader.join)


def weight_sender_at(address: str, plan, device, *, alive, checksum_row_stride: int = 1, num_slots: int = 2,
                     timeout: float = 300.0):
    """``EmbeddedEngineProcess.weight_sender`` from another process of the engine's node, for an engine started
    with ``weights_from_elsewhere``: connects to its ``weight_address`` (with this process's authkey, which the
    engine's must equal); ``alive()``: whether the engine process still runs."""
    return _sender(Client(address, family="AF_UNIX", authkey=mp.current_process().authkey), plan, device,
                   alive=alive, num_slots=num_slots, timeout=timeout, checksum_row_stride=checksum_row_stride)


def _sender(conn, plan, device, *, alive, num_slots: int, timeout: float, checksum_row_stride: int):
    from redline.rollout.embedded.colocated import transport_kind
    from redline.sync.protocol import WeightSender
    from redline.sync.receiver import make_transport

    device = torch.device(device)
    return WeightSender(conn, make_transport(transport_kind(device), device), plan, num_slots=num_slots,
                        timeout=timeout, alive=alive, checksum_row_stride=checksum_row_stride)
