"""The pipelined colocated sync protocol: sender (trainer) and receiver (engine process) over a channel.

One sync is a session::

    sender                                   receiver
    begin {slots, ready fences}          --> open every slot and fence once
                                         <-- opened {done fences}
    per bucket k (slot s = k mod N):
      wait ack of bucket k-N (host), done[s].wait() (device): the receiver has finished reading slot s
      pack bucket k into slot s, checksum it, ready[s].record()
      bucket {k, s, layout}               --> ready[s].wait(); load views of slot s; checksum slot s;
                                              done[s].record()
                                         <-- done k          (sent as soon as the work is queued)
    end                                  --> synchronize the device
                                         <-- checksums [[plain, weighted] per bucket]
    compare with the sender's checksums: any difference raises ChecksumMismatch

So the sender packs bucket k+1 while the receiver loads bucket k, and a slot is overwritten only after the
receiver's reads of it are complete on the device (the ack carries the fence; the device waits on it), which
is the handshake whose absence corrupts weights in the anchors (sync.md §4). Neither side blocks its host on
the device until ``end``. In zero-copy mode the slots are the trainer's own flat parameter storages (one per
bucket, never overwritten during the session), so nothing is packed.

Messages are ``(kind, session, payload)`` tuples over a ``multiprocessing`` connection; the session number lets
either side discard what is left of a session that failed.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from redline.sync.checksum import bucket_checksum
from redline.sync.plan import BucketLayout, WeightPlan, bucketize
from redline.sync.transport import Transport

NamedViews = list[tuple[str, torch.Tensor]]
DEFAULT_TIMEOUT_S = 300.0


class SyncError(RuntimeError):
    """A weight sync did not complete; the engine's weights are partially updated and must be re-synced."""


class ChecksumMismatch(SyncError):
    """The receiver read different bytes than the sender packed."""


class ReceiverFailed(SyncError):
    """The receiver raised, exited or stopped answering."""


@dataclass(frozen=True)
class SyncReport:
    """What one sync did. Times are host wall-clock seconds; ``seconds`` ends after the checksum comparison."""

    mode: str  # "pipelined" | "zero-copy" | "broadcast"
    buckets: int
    nbytes: int
    seconds: float
    ack_wait_seconds: float  # host time spent waiting for the receiver to free a slot

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else float("inf")


class WeightSender:
    """Trainer side of the protocol for one receiver, one connection, any number of syncs.

    ``conn``: a ``multiprocessing`` connection to a process running ``serve``. ``plan``: the bucket plan of the
    model's export. ``num_slots``: staging buffers of ``plan.capacity`` bytes each (2 = ping-pong).
    ``alive``: optional check that the receiver process still runs (a dead one is reported, not waited for).
    ``checksum_row_stride``: checksum every row (1, the default) or every n-th row of each bucket (see
    ``redline.sync.checksum``); the receiver uses the sender's choice.
    """

    def __init__(self, conn, transport: Transport, plan: WeightPlan, *, num_slots: int = 2,
                 timeout: float = DEFAULT_TIMEOUT_S, alive: Callable[[], bool] | None = None,
                 checksum_row_stride: int = 1):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not plan.buckets:
            raise ValueError("the weight plan has no buckets: nothing to sync")
        self.conn, self.transport, self.plan = conn, transport, plan
        self.num_slots, self.timeout, self.alive = num_slots, timeout, alive
        if checksum_row_stride < 1:
            raise ValueError(f"checksum_row_stride must be >= 1, got {checksum_row_stride}")
        self.row_stride = checksum_row_stride
        self.session = 0
        self._last_index = -1
        self._ended = True

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Pack and send the export ``named_tensors`` (plan order, see ``bucketize``), then check checksums."""
        start = time.perf_counter()
        slots = [self.transport.allocate(self.plan.capacity) for _ in range(min(self.num_slots,
                                                                              len(self.plan.buckets)))]
        ready = [self.transport.new_fence() for _ in slots]
        done = self._begin(slots, ready, reuse=True)
        sums, ack_wait = [], 0.0
        with self._aborting():
            for layout, tensors in bucketize(self.plan, named_tensors):
                slot = layout.index % len(slots)
                if layout.index >= len(slots):
                    waited = time.perf_counter()
                    self._await_done(layout.index - len(slots))
                    ack_wait += time.perf_counter() - waited
                    done[slot].wait()
                # one multi-tensor launch per bucket on CUDA (a per-tensor loop on CPU)
                torch._foreach_copy_([m.view(slots[slot]) for m in layout.tensors], list(tensors))
                sums.append(bucket_checksum(slots[slot], layout.nbytes, self.row_stride))
                ready[slot].record()
                self._send("bucket", index=layout.index, slot=slot, fence=slot, layout=layout)
            self._finish(sums)
        del slots
        self._release_ipc()
        return SyncReport("pipelined", len(sums), self.plan.nbytes, time.perf_counter() - start, ack_wait)

    def sync_flat(self, flat_buckets: Sequence[torch.Tensor]) -> SyncReport:
        """Zero-copy sync: ``flat_buckets[i]`` is a flat uint8 tensor already holding bucket ``i`` in the plan's
        layout (the trainer's parameters live in it); it is exported as is and nothing is packed."""
        if len(flat_buckets) != len(self.plan.buckets):
            raise ValueError(f"sync_flat got {len(flat_buckets)} flat buckets, the plan has "
                             f"{len(self.plan.buckets)}")
        for layout, flat in zip(self.plan.buckets, flat_buckets):
            if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < layout.nbytes:
                raise ValueError(f"flat bucket {layout.index} must be flat uint8 of >= {layout.nbytes} bytes, "
                                 f"got {flat.dtype} {tuple(flat.shape)}")
        start = time.perf_counter()
        ready = [self.transport.new_fence()]
        ready[0].record()  # whatever wrote the parameters is ordered before every receiver read
        self._begin(list(flat_buckets), ready, reuse=False)
        sums = []
        with self._aborting():
            for layout, flat in zip(self.plan.buckets, flat_buckets):
                sums.append(bucket_checksum(flat, layout.nbytes, self.row_stride))
                self._send("bucket", index=layout.index, slot=layout.index, fence=0, layout=layout)
            self._finish(sums)
        self._release_ipc()
        return SyncReport("zero-copy", len(sums), self.plan.nbytes, time.perf_counter() - start, 0.0)

    def close(self) -> None:
        """Tell the receiver to stop serving; the connection is closed."""
        try:
            self.conn.send(("close", self.session, {}))
        finally:
            self.conn.close()

    # -- protocol steps ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _aborting(self):
        """On any failure inside a session, tell the receiver the session is over (best effort), so it
        serves the next one; what it answers carries this session's number and is discarded later."""
        try:
            yield
        except BaseException:
            if not self._ended:
                with contextlib.suppress(Exception):
                    self.conn.send(("end", self.session, {}))
            raise

    def _begin(self, slots, ready, *, reuse: bool):
        self.session += 1
        self._last_index = -1
        self._ended = False
        self._send("begin", slots=[self.transport.export(s) for s in slots], ready=[f.handle() for f in ready],
                   reuse=reuse, row_stride=self.row_stride)
        opened = self._expect("opened", "opening the staging buffers")
        return [self.transport.open_fence(h) for h in opened["done"]]

    def _finish(self, sums: list[torch.Tensor]) -> None:
        self._send("end")
        self._ended = True
        self._await_done(len(sums) - 1)  # acks the loop did not need come before the checksums
        got = self._expect("checksums", "finishing the sync")["sums"]
        want = torch.stack(sums).tolist()  # the sender's one host synchronisation
        bad = [i for i, (w, g) in enumerate(zip(want, got)) if w != g]
        if bad or len(got) != len(want):
            names = [self.plan.buckets[i].names[:3] for i in bad[:3]]
            raise ChecksumMismatch(f"session {self.session}: receiver checksums differ for buckets {bad} "
                                   f"(first tensors: {names}); received {len(got)} of {len(want)} buckets")

    def _await_done(self, index: int) -> None:
        while self._last_index < index:
            self._last_index = self._expect("done", f"loading bucket {self._last_index + 1}")["index"]

    def _send(self, kind: str, **payload) -> None:
        try:
            self.conn.send((kind, self.session, payload))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise ReceiverFailed(f"the receiver closed the channel (sending {kind!r}): {exc}") from exc

    def _expect(self, kind: str, doing: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.alive is not None and not self.alive() and not self.conn.poll(0):
                raise ReceiverFailed(f"the receiver process exited while {doing} (session {self.session})")
            if not self.conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise ReceiverFailed(f"the receiver did not answer within {self.timeout:.0f} s while {doing}")
                continue
            try:
                got, session, payload = self.conn.recv()
            except (EOFError, ConnectionResetError, OSError) as exc:
                raise ReceiverFailed(f"the receiver closed the channel while {doing} "
                                     f"(session {self.session}); did it crash?") from exc
            if session != self.session:
                continue  # left over from a session that failed
            if got == "error":
                self._send("end")  # lets the receiver drain this session
                self._ended = True
                raise ReceiverFailed(f"the receiver failed on bucket {payload['index']}:\n{payload['traceback']}")
            if got != kind:
                raise SyncError(f"protocol error: expected {kind!r} from the receiver, got {got!r}")
            return payload

    def _release_ipc(self) -> None:
        # Producer-side CUDA IPC blocks stay pinned until collected (sync.md §4: the IPC cache leak).
        if self.transport.device.type == "cuda":
            torch.cuda.ipc_collect()


def serve(conn, transport: Transport, load: Callable[[NamedViews], None]) -> None:
    """Receiver side: serve sync sessions on ``conn`` until the sender closes it.

    ``load(views)`` gets each bucket as ``[(hf_name, view)]``. Names the plan dropped as aliases (a tied
    lm_head) are not sent: the receiving model derives them (see ``TargetLoader``'s ``aliases``). The views
    alias the shared slot and are valid only during the call: ``load`` must copy out of them (queued
    device copies are fine; the protocol orders them before the slot is reused). An exception from ``load`` is
    reported to the sender with its traceback and ends the session; the receiver keeps serving.
    """
    while True:
        try:
            kind, session, payload = conn.recv()
        except EOFError:
            return
        if kind == "close":
            return
        if kind == "begin":
            try:
                _serve_session(conn, transport, load, session, payload)
            except EOFError:  # the sender went away mid-session
                return
        # anything else is a leftover of a failed session: ignore it


def _serve_session(conn, transport: Transport, load, session: int, begin: dict) -> None:
    slots = [transport.open(h) for h in begin["slots"]]
    ready = [transport.open_fence(h) for h in begin["ready"]]
    done = [transport.new_fence() for _ in slots] if begin["reuse"] else []
    conn.send(("opened", session, {"done": [f.handle() for f in done]}))
    sums = []
    while True:
        kind, got_session, payload = conn.recv()
        if got_session != session:
            continue
        if kind == "end":
            transport.synchronize()
            conn.send(("checksums", session, {"sums": torch.stack(sums).tolist() if sums else []}))
            return
        layout: BucketLayout = payload["layout"]
        try:
            slot = slots[payload["slot"]]
            ready[payload["fence"]].wait()
            load(layout.views(slot))
            sums.append(bucket_checksum(slot, layout.nbytes, begin["row_stride"]))
            if done:
                done[payload["slot"]].record()
        except Exception:
            conn.send(("error", session, {"index": layout.index, "traceback": traceback.format_exc()}))
            _drain(conn, session)
            return
        conn.send(("done", session, {"index": layout.index}))


def _drain(conn, session: int) -> None:
    """Discard the rest of a failed session, up to the sender's ``end`` (EOFError if the sender is gone)."""
    while True:
        kind, got_session, _ = conn.recv()
        if kind == "end" and got_session == session:
            return
