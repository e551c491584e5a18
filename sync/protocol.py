"""The pipelined colocated sync protocol: sender (trainer) and receiver (engine process) over a channel.

One sync is a session::

    sender                                   receiver
    begin {buffers to map / unmap,       --> map new buffers and fences (kept mapped across sessions),
           slots, ready fences, plan}         create missing done fences
                                         <-- opened {new done fences}
    pipelined, per bucket k (slot s = k mod N):
      wait ack of bucket k-N (host), done[s].wait() (device): the receiver has finished reading slot s
      pack bucket k into slot s and checksum it (one fused pass), ready[s].record()
      bucket {k, s}                      --> ready[s].wait(); load slot s and checksum it (one fused pass);
                                              done[s].record()
                                         <-- done k          (sent as soon as the work is queued)
    zero-copy: ready.record(); checksum every flat bucket
      buckets {all k}                    --> ready.wait(); load and checksum every bucket (no acks)
    shared (zero-copy with ``share``): begin carries share; the receiver's loader takes the flat buckets as its
      weights (once; then an identity check) and "loading" a bucket is its checksum alone
    end                                  --> synchronize the device
                                         <-- checksums [[plain, weighted] per bucket]
    compare with the sender's checksums: any difference raises ChecksumMismatch

So the sender packs bucket k+1 while the receiver loads bucket k, and a slot is overwritten only after the
receiver's reads of it are complete on the device (the ack carries the fence; the device waits on it), which
is the handshake whose absence corrupts weights in the anchors (sync.md §4). Neither side blocks its host on
the device until ``end``; the receiver's ``end`` synchronisation also completes every read of the session, so
the next session may reuse any slot. In zero-copy mode the slots are the trainer's own flat parameter storages
(one per bucket, never written during the session), so nothing is packed; shared, nothing is copied either: the
engine reads the trainer's storage as its weights, and the sender promises not to write it while the engine
generates (a colocated, synchronous loop). A session without ``share``, and ``forget``, make the loader copy
what it shared into its own memory first (``unshare``).

What is set up once, not per sync: the staging slots (allocated at the first sync, kept by the sender), their
CUDA IPC mappings in the receiver (a ``cudaIpcOpenMemHandle`` / close pair and a fresh allocation per buffer
and sync is what the earlier per-sync version paid), the fences, the bucket plan (sent once; buckets are then
named by index) and the checksum accumulators. Zero-copy buffers stay mapped while they are used; a buffer a
later sync no longer names is unmapped at that sync's ``begin``, a one-shot buffer (``keep_mapped=False``) at
its ``end``, everything of a sender at its ``release()`` (``forget``). Memory therefore stays flat from one
sync to the next.

Messages are ``(kind, session, payload)`` tuples over a ``multiprocessing`` connection, the payload naming the
sender (the receiver keeps one state per sender); session numbers are unique in the sending process, so either
side can discard what is left of a session that failed.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from redline.sync.bucket_copy import BucketCopier
from redline.sync.checksum import bucket_checksum, fold, new_accumulator
from redline.sync.plan import BucketLayout, WeightPlan, bucketize
from redline.sync.transport import Transport

NamedViews = list[tuple[str, torch.Tensor]]
DEFAULT_TIMEOUT_S = 300.0
# Process-wide counters: several senders may share one connection (each gets its own state in the receiver),
# and their session numbers never collide, so leftovers of one sender's failed session are never taken for
# another's.
_SENDER_IDS = itertools.count(1)
_SESSIONS = itertools.count(1)


class SyncError(RuntimeError):
    """A weight sync did not complete; the engine's weights are partially updated and must be re-synced."""


class ChecksumMismatch(SyncError):
    """The receiver read different bytes than the sender packed."""


class ReceiverFailed(SyncError):
    """The receiver raised, exited or stopped answering."""


@dataclass(frozen=True)
class SyncReport:
    """What one sync did. Times are host wall-clock seconds; ``seconds`` ends after the checksum comparison."""

    mode: str  # "pipelined" | "zero-copy" | "shared" | "broadcast"
    buckets: int
    nbytes: int
    seconds: float
    ack_wait_seconds: float  # host time spent waiting for the receiver to free a slot

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else float("inf")


def buffer_key(buffer: torch.Tensor) -> tuple[int, int]:
    """How both sides name a shared buffer: its address and size in the sender (unique while it is mapped,
    because a buffer the receiver maps cannot be freed and reused by the sender's allocator)."""
    return buffer.data_ptr(), buffer.numel()


def layout_spans(layout: BucketLayout) -> list[tuple[int, int]]:
    return [(t.start_idx, t.end_idx) for t in layout.tensors]


def _contiguous(layout: BucketLayout) -> bool:
    """The tensors cover the bucket's bytes without gaps (every ``plan_buckets`` layout does)."""
    return layout.tensors[0].start_idx == 0 and all(a.end_idx == b.start_idx
                                                    for a, b in zip(layout.tensors, layout.tensors[1:]))


class WeightSender:
    """Trainer side of the protocol for one receiver, one connection, any number of syncs.

    ``conn``: a ``multiprocessing`` connection to a process running ``serve`` (several senders may share one).
    ``plan``: the bucket plan of the model's export. ``num_slots``: staging buffers of ``plan.capacity`` bytes
    each (2 = ping-pong), allocated at the first ``sync`` and kept, like the receiver's mappings, until
    ``release()``. ``alive``: optional check that the receiver process still runs (a dead one is reported, not
    waited for). ``checksum_row_stride``: checksum every row (1, the default) or every n-th row of each bucket
    (see ``redline.sync.checksum``); the receiver uses the sender's choice. ``copier``: the fused copy +
    checksum (``BucketCopier``; its default backend unless given).
    """

    def __init__(self, conn, transport: Transport, plan: WeightPlan, *, num_slots: int = 2,
                 timeout: float = DEFAULT_TIMEOUT_S, alive: Callable[[], bool] | None = None,
                 checksum_row_stride: int = 1, copier: BucketCopier | None = None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not plan.buckets:
            raise ValueError("the weight plan has no buckets: nothing to sync")
        if checksum_row_stride < 1:
            raise ValueError(f"checksum_row_stride must be >= 1, got {checksum_row_stride}")
        self.conn, self.transport, self.plan = conn, transport, plan
        self.num_slots, self.timeout, self.alive = num_slots, timeout, alive
        self.row_stride = checksum_row_stride
        self.copier = copier or BucketCopier()
        self.sender_id = next(_SENDER_IDS)
        self.session = 0
        self._last_index = -1
        self._ended = True
        self._spans = [layout_spans(b) for b in plan.buckets]
        self._slots: list[torch.Tensor] = []
        self._ready: dict[str, object] = {}  # fence key -> fence (slot fences and the zero-copy fence)
        self._done: list = []  # the receiver's done fences, opened once
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}  # buffers the receiver has mapped (kept alive)
        self._fences_sent: set[str] = set()
        self._plan_sent = False
        self._reset = True  # the first begin has the receiver set up this sender's state from nothing
        self._unmapped_some = False
        self._acc: torch.Tensor | None = None

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: str | None = None) -> SyncReport:
        """Pack and send the export ``named_tensors`` (plan order, see ``bucketize``), then check checksums.
        ``version``: published by the receiver once the buckets are loaded (``serve``), no round trip of its own."""
        start = time.perf_counter()
        slots = self._staging()
        ready = [self._fence(f"slot{i}") for i in range(len(slots))]
        done = self._begin(slots, [f"slot{i}" for i in range(len(slots))], num_done=len(slots), keep=slots)
        acc, ack_wait = self._accumulator(), 0.0
        with self._aborting():
            for layout, tensors in bucketize(self.plan, named_tensors):
                slot = layout.index % len(slots)
                if layout.index >= len(slots):
                    waited = time.perf_counter()
                    self._await_done(layout.index - len(slots))
                    ack_wait += time.perf_counter() - waited
                done[slot].wait()  # the receiver's reads of this slot are complete before we overwrite it
                self.copier.pack(slots[slot], layout.nbytes, self._spans[layout.index], tensors, acc[layout.index],
                                 self.row_stride)
                ready[slot].record()
                self._send("bucket", index=layout.index, slot=slot)
            self._finish(len(self.plan.buckets), acks=True, version=version)
        return SyncReport("pipelined", len(self.plan.buckets), self.plan.nbytes, time.perf_counter() - start,
                          ack_wait)

    def sync_flat(self, flat_buckets: Sequence[torch.Tensor], *, keep_mapped: bool = True,
                  version: str | None = None, share: bool = False) -> SyncReport:
        """Zero-copy sync: ``flat_buckets[i]`` is a flat uint8 tensor already holding bucket ``i`` in the plan's
        layout (the trainer's parameters live in it); it is shared as is and nothing is packed. The receiver
        keeps the buffers mapped for the next sync (``keep_mapped``), or unmaps them when this one ends (for
        buffers made for one sync only: their memory is freed once the caller drops them). ``version``: as
        ``sync``'s. ``share``: the receiver's loader takes the buffers as its weights (``TargetLoader``-style
        ``share(flats, plan)``) and only checksums them; the caller must not write them until the next sync.
        SyncError, naming the receiver's reason, if it could not (it copied them then, checked as usual)."""
        if share and not keep_mapped:
            raise ValueError("sync_flat: shared buffers stay the receiver's weights, so they must stay mapped")
        if len(flat_buckets) != len(self.plan.buckets):
            raise ValueError(f"sync_flat got {len(flat_buckets)} flat buckets, the plan has "
                             f"{len(self.plan.buckets)}")
        for layout, flat in zip(self.plan.buckets, flat_buckets):
            if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < layout.nbytes:
                raise ValueError(f"flat bucket {layout.index} must be flat uint8 of >= {layout.nbytes} bytes, "
                                 f"got {flat.dtype} {tuple(flat.shape)}")
        start = time.perf_counter()
        ready = self._fence("flat")
        ready.record()  # whatever wrote the parameters is ordered before every receiver read
        self._begin(list(flat_buckets), ["flat"] * len(flat_buckets), num_done=0, keep=self._slots, share=share)
        acc = self._accumulator()
        with self._aborting():
            for layout, flat in zip(self.plan.buckets, flat_buckets):
                if _contiguous(layout):
                    self.copier.checksum(flat, layout.nbytes, acc[layout.index], self.row_stride)
                else:  # gaps (a storage's alignment padding, ``redline.sync.zero_copy``): the spans, as loaded
                    self.copier.unpack(flat, layout.nbytes, self._spans[layout.index], [None] * len(layout.tensors),
                                       acc[layout.index], self.row_stride)
            indices = list(range(len(flat_buckets)))
            self._send("buckets", indices=indices, slots=indices)
            unmap = [] if keep_mapped else [buffer_key(f) for f in flat_buckets]
            got = self._finish(len(flat_buckets), acks=False, unmap=unmap, version=version)
        if share and got.get("not_shared"):
            raise SyncError(f"session {self.session}: the receiver did not take the buffers as its weights (it "
                            f"copied them): {got['not_shared']}")
        return SyncReport("shared" if share else "zero-copy", len(flat_buckets), self.plan.nbytes,
                          time.perf_counter() - start, 0.0)

    def release(self) -> None:
        """Give back what this sender keeps between syncs: the receiver unmaps every buffer (staging slots,
        zero-copy buffers) and forgets this sender's fences and plan; the staging slots are freed. The next
        sync sets everything up again."""
        self.session = next(_SESSIONS)
        self._send("forget")
        self._expect("forgotten", "releasing the sync buffers")
        self._slots, self._mapped, self._done = [], {}, []
        self._fences_sent.clear()
        self._plan_sent, self._reset = False, True
        self._release_ipc()

    def close(self) -> None:
        """Tell the receiver to stop serving; the connection is closed."""
        try:
            self.conn.send(("close", self.session, {}))
        finally:
            self.conn.close()

    # -- protocol steps ------------------------------------------------------------------------------------
    def _staging(self) -> list[torch.Tensor]:
        if not self._slots:
            count = min(self.num_slots, len(self.plan.buckets))
            self._slots = [self.transport.allocate(self.plan.capacity) for _ in range(count)]
        return self._slots

    def _fence(self, key: str):
        if key not in self._ready:
            self._ready[key] = self.transport.new_fence()
        return self._ready[key]

    def _accumulator(self) -> torch.Tensor:
        if self._acc is None:
            self._acc = new_accumulator(len(self.plan.buckets), self.transport.device)
        self._acc.zero_()
        return self._acc

    @contextlib.contextmanager
    def _aborting(self):
        """On any failure inside a session, tell the receiver the session is over (best effort), so it
        serves the next one; what it answers carries this session's number and is discarded later."""
        try:
            yield
        except BaseException:
            if not self._ended:
                with contextlib.suppress(Exception):
                    self.conn.send(("end", self.session, {"sender": self.sender_id}))
            raise

    def _begin(self, buffers: list[torch.Tensor], fence_keys: list[str], *, num_done: int,
               keep: list[torch.Tensor], share: bool = False):
        """Start a session reading ``buffers`` (slot i after fence ``fence_keys[i]``); buffers in ``keep`` stay
        mapped even when this session does not read them; ``share``: see ``sync_flat``. Returns the receiver's
        done fences."""
        self.session = next(_SESSIONS)
        self._last_index = -1
        self._ended = False
        keys = [buffer_key(b) for b in buffers]
        wanted = set(keys) | {buffer_key(b) for b in keep}
        close = [k for k in self._mapped if k not in wanted]
        open_ = {}
        for key, buffer in zip(keys, buffers):
            if key not in self._mapped:
                open_[key] = self.transport.export(buffer)
                self._mapped[key] = buffer
        for key in close:
            del self._mapped[key]
        new_fences = {k: self._ready[k].handle() for k in dict.fromkeys(fence_keys) if k not in self._fences_sent}
        self._send("begin", open=open_, close=close, open_fences=new_fences, slots=keys, ready=fence_keys,
                   num_done=num_done, plan=None if self._plan_sent else self.plan, row_stride=self.row_stride,
                   reset=self._reset, share=share)
        try:
            opened = self._expect("opened", "opening the staging buffers")
        except BaseException:
            # Whatever the receiver mapped is unknown now: the next session starts from nothing on both sides.
            self._mapped.clear()
            self._fences_sent.clear()
            self._done.clear()
            self._plan_sent, self._reset = False, True
            raise
        self._fences_sent |= set(new_fences)
        self._plan_sent, self._reset = True, False
        for index, handle in sorted(opened["done"].items()):
            if index != len(self._done):
                raise SyncError(f"protocol error: the receiver sent done fence {index}, expected {len(self._done)}")
            self._done.append(self.transport.open_fence(handle))
        self._unmapped_some = bool(close)
        return self._done

    def _finish(self, count: int, *, acks: bool, unmap: Sequence[tuple[int, int]] = (),
                version: str | None = None) -> dict:
        """End the session, compare the checksums; the receiver's answer."""
        self._send("end", unmap=list(unmap), version=version)
        self._ended = True
        if acks:
            self._await_done(count - 1)  # acks the loop did not need come before the checksums
        got = self._expect("checksums", "finishing the sync")
        want = fold(self._acc[:count]).tolist()  # the sender's one host synchronisation
        for key in unmap:
            self._mapped.pop(key, None)
        if self._unmapped_some or unmap:  # the receiver has let go of them: their blocks can be freed now
            self._unmapped_some = False
            self._release_ipc()
        received = dict(zip(got["indices"], got["sums"]))
        bad = [i for i in range(count) if received.get(i) != want[i]]
        if bad:
            names = [self.plan.buckets[i].names[:3] for i in bad[:3]]
            raise ChecksumMismatch(f"session {self.session}: receiver checksums differ for buckets {bad} "
                                   f"(first tensors: {names}); received {len(received)} of {count} buckets")
        if version is not None and not got.get("published"):
            raise SyncError(f"session {self.session}: the receiver's loader has no publish_version, so weight "
                            f"version {version!r} was not published; publish it another way (version=None)")
        return got

    def _await_done(self, index: int) -> None:
        while self._last_index < index:
            self._last_index = self._expect("done", f"loading bucket {self._last_index + 1}")["index"]

    def _send(self, kind: str, **payload) -> None:
        try:
            self.conn.send((kind, self.session, {"sender": self.sender_id, **payload}))
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
                if not self._ended:
                    self._send("end")  # lets the receiver drain this session
                    self._ended = True
                where = f"on bucket {payload['index']}" if payload["index"] >= 0 else f"while {doing}"
                raise ReceiverFailed(f"the receiver failed {where}:\n{payload['traceback']}")
            if got != kind:
                raise SyncError(f"protocol error: expected {kind!r} from the receiver, got {got!r}")
            return payload

    def _release_ipc(self) -> None:
        # Producer-side CUDA IPC blocks stay pinned until collected (sync.md §4: the IPC cache leak).
        if self.transport.device.type == "cuda":
            torch.cuda.ipc_collect()


# -- receiver ------------------------------------------------------------------------------------------------
class _SenderState:
    """What the receiver keeps across one sender's sessions: mapped buffers and fences, its plan, its
    checksum accumulators."""

    def __init__(self):
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.fences: dict[str, object] = {}
        self.done: list = []
        self.plan: WeightPlan | None = None
        self.acc: torch.Tensor | None = None


class _Receiver:
    def __init__(self, conn, transport: Transport, load):
        self.conn, self.transport, self.load = conn, transport, load
        self.fused = getattr(load, "load_bucket", None)
        self.senders: dict[int, _SenderState] = {}

    def session(self, session: int, begin: dict) -> None:
        try:
            if begin["reset"] or begin["sender"] not in self.senders:
                # a new sender, or one that lost track of a failed begin: start from nothing
                self.senders[begin["sender"]] = _SenderState()
            state = self.senders[begin["sender"]]
            slots, ready, reuse, row_stride = self._open(state, session, begin)
            not_shared = self._share(begin.get("share", False), slots, state.plan)
        except Exception:
            self.conn.send(("error", session, {"index": -1, "traceback": traceback.format_exc()}))
            _drain(self.conn, session)
            return
        received = []
        while True:
            kind, got_session, payload = self.conn.recv()
            if got_session != session:
                continue
            if kind == "end":
                self.transport.synchronize()
                _unmap(state, payload.get("unmap", ()))
                slots.clear()  # this session's references: unmapped buffers are released before we answer
                sums = fold(state.acc[received]).tolist() if received else []
                version = payload.get("version")
                publish = getattr(self.load, "publish_version", None)
                if version is not None and publish is not None:
                    try:
                        publish(version)
                    except Exception:
                        self.conn.send(("error", session, {"index": -1, "traceback": traceback.format_exc()}))
                        return
                self.conn.send(("checksums", session, {"indices": received, "sums": sums, "not_shared": not_shared,
                                                       "published": version is not None and publish is not None}))
                return
            indices, slot_numbers = ((payload["indices"], payload["slots"]) if kind == "buckets"
                                     else ([payload["index"]], [payload["slot"]]))
            for index, slot in zip(indices, slot_numbers):
                try:
                    self._load(state, index, slots[slot], ready[slot], row_stride)
                    if reuse:
                        state.done[slot].record()
                except Exception:
                    self.conn.send(("error", session, {"index": index, "traceback": traceback.format_exc()}))
                    _drain(self.conn, session)
                    return
                received.append(index)
                if reuse:
                    self.conn.send(("done", session, {"index": index}))

    def forget(self, sender: int) -> None:
        """Drop everything of ``sender`` (its buffers are unmapped once the device is done with them); a loader
        that shared them copies them first."""
        self._share(False, [], None)
        self.transport.synchronize()
        self.senders.pop(sender, None)

    def _share(self, wanted: bool, buffers: list[torch.Tensor], plan: WeightPlan | None) -> str | None:
        """Offered (``wanted``): the loader takes ``buffers`` as its weights; None, or why it could not. Not
        offered: a loader that shares anything takes its own copy back (the sender may write its buffers now)."""
        if not wanted:
            unshare = getattr(self.load, "unshare", None)
            if unshare is not None:
                unshare()
            return None
        share = getattr(self.load, "share", None)
        if share is None:
            return f"its loader ({type(self.load).__name__}) cannot take buffers as its weights"
        return share(buffers, plan)

    def _open(self, state: _SenderState, session: int, begin: dict):
        _unmap(state, begin["close"])
        for key, handle in begin["open"].items():
            state.buffers[key] = self.transport.open(handle)
        for key, handle in begin["open_fences"].items():
            state.fences[key] = self.transport.open_fence(handle)
        if begin["plan"] is not None:
            state.plan = begin["plan"]
            state.acc = new_accumulator(len(state.plan.buckets), self.transport.device)
        if state.plan is None:
            raise RuntimeError("protocol error: the sender never sent its bucket plan")
        new_done = {}
        while len(state.done) < begin["num_done"]:
            fence = self.transport.new_fence()
            new_done[len(state.done)] = fence.handle()
            state.done.append(fence)
        slots = [state.buffers[k] for k in begin["slots"]]
        ready = [state.fences[k] for k in begin["ready"]]
        state.acc.zero_()
        self.conn.send(("opened", session, {"done": new_done}))
        return slots, ready, begin["num_done"] > 0, begin["row_stride"]

    def _load(self, state: _SenderState, index: int, slot: torch.Tensor, ready, row_stride: int) -> None:
        layout = state.plan.buckets[index]
        ready.wait()
        if self.fused is not None:
            self.fused(slot, layout, state.acc[index], row_stride)
        else:
            self.load(layout.views(slot))
            state.acc[index, 0] += bucket_checksum(slot, layout.nbytes, row_stride)


def _unmap(state: _SenderState, keys) -> None:
    for key in keys:
        state.buffers.pop(key, None)


def serve(conn, transport: Transport, load: Callable[[NamedViews], None]) -> None:
    """Receiver side: serve sync sessions on ``conn`` until the sender closes it.

    ``load(views)`` gets each bucket as ``[(hf_name, view)]``. Names the plan dropped as aliases (a tied
    lm_head) are not sent: the receiving model derives them (see ``TargetLoader``'s ``aliases``). The views
    alias the shared slot and are valid only during the call: ``load`` must copy out of them (queued
    device copies are fine; the protocol orders them before the slot is reused). A ``load`` object with a
    ``load_bucket(flat, layout, acc, row_stride)`` method (``TargetLoader``) is called that way instead: it
    copies the bucket out of ``flat`` and adds the bucket's checksum to ``acc`` in the same pass
    (``redline.sync.bucket_copy``); otherwise the receiver checksums the slot after ``load``. An exception from
    ``load`` is reported to the sender with its traceback and ends the session; the receiver keeps serving.
    A ``load`` with ``publish_version(version)`` gets the version a sync carries (``WeightSender.sync``'s
    ``version``) once that sync's buckets are loaded, before the checksums go back: the sender compares them after,
    and a mismatch raises there (the run stops with the engine's weights labelled but wrong); an exception from
    ``publish_version`` fails the sync like one from ``load``. A ``load`` with ``share(flats, plan)`` (returning None,
    or why not) and ``unshare()`` takes part in shared syncs (``WeightSender.sync_flat(share=True)``).
    """
    receiver = _Receiver(conn, transport, load)
    while True:
        try:
            kind, session, payload = conn.recv()
        except EOFError:
            return
        if kind == "close":
            return
        if kind == "begin":
            try:
                receiver.session(session, payload)
            except EOFError:  # the sender went away mid-session
                return
        elif kind == "forget":
            try:
                receiver.forget(payload["sender"])
            except Exception:  # noqa: BLE001 - e.g. no room to copy what the loader shared: the sender learns why
                conn.send(("error", session, {"index": -1, "traceback": traceback.format_exc()}))
                continue
            conn.send(("forgotten", session, {}))
        # anything else is a leftover of a failed session: ignore it


def _drain(conn, session: int) -> None:
    """Discard the rest of a failed session, up to the sender's ``end`` (EOFError if the sender is gone)."""
    while True:
        kind, got_session, _ = conn.recv()
        if kind == "end" and got_session == session:
            return
