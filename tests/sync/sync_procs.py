"""Receiver processes for the protocol tests (entry points must be importable by the child process)."""

import os
import time
import weakref

import torch

from redline.sync.bucket_copy import BucketCopier
from redline.sync.receiver import TargetLoader, make_transport, receive_forever
from redline.sync.transport import SharedMemoryTransport


def copy_receiver(conn, targets, aliases=None):
    receive_forever(conn, make_transport("shm"), TargetLoader(targets, aliases=aliases))


def watching_receiver(conn, targets, produced, seen, delay):
    """Before loading its k-th bucket, note how many tensors the sender had produced; then load slowly."""
    loader = TargetLoader(targets)
    calls = [0]

    def load(views):
        seen[calls[0]] = produced[0]
        time.sleep(delay)  # a slow engine: the sender must not overwrite this slot meanwhile
        loader(views)
        calls[0] += 1

    receive_forever(conn, make_transport("shm"), load)


def corrupting_receiver(conn, targets, bad_call):
    """Loads correctly but scribbles on the shared slot of its ``bad_call``-th bucket (as a racing writer
    would)."""
    loader = TargetLoader(targets)
    calls = [0]

    def load(views):
        loader(views)
        if calls[0] == bad_call:
            views[0][1].view(-1)[0] += 1
        calls[0] += 1

    receive_forever(conn, make_transport("shm"), load)


def crashing_receiver(conn, targets, crash_call):
    loader = TargetLoader(targets)
    calls = [0]

    def load(views):
        if calls[0] == crash_call:
            os._exit(3)
        loader(views)
        calls[0] += 1

    receive_forever(conn, make_transport("shm"), load)


def failing_once_receiver(conn, targets):
    """Raises on its first bucket ever, then behaves."""
    loader = TargetLoader(targets)
    failed = [False]

    def load(views):
        if not failed[0]:
            failed[0] = True
            raise RuntimeError("engine refused bucket: simulated load failure")
        loader(views)

    receive_forever(conn, make_transport("shm"), load)


class _FailingOpenTransport(SharedMemoryTransport):
    """Cannot map the first buffer it is sent."""

    def __init__(self):
        self.failed = False

    def open(self, handle):
        if not self.failed:
            self.failed = True
            raise RuntimeError("simulated mapping failure")
        return super().open(handle)


def failing_open_receiver(conn, targets):
    """Fails to map the first buffer of its first session, then behaves."""
    receive_forever(conn, _FailingOpenTransport(), TargetLoader(targets))


def shared_zeros_like(named_tensors):
    """``{name: zeros}`` in shared memory, visible to the parent after the child writes them."""
    return {n: torch.zeros_like(t).share_memory_() for n, t in named_tensors}


class CountingTransport(SharedMemoryTransport):
    """Shared memory that counts, in the shared ``counts`` tensor, buffers opened ([0]) and still mapped ([1])."""

    def __init__(self, counts):
        self.counts = counts

    def open(self, handle):
        buffer = super().open(handle)
        self.counts[0] += 1
        self.counts[1] += 1
        weakref.finalize(buffer, self._unmapped)
        return buffer

    def _unmapped(self):
        self.counts[1] -= 1


def counting_receiver(conn, targets, counts):
    receive_forever(conn, CountingTransport(counts), TargetLoader(targets))


def triton_receiver(conn, targets):
    """Loads with the fused Triton kernel (Triton's interpreter on CPU)."""
    receive_forever(conn, make_transport("shm"), TargetLoader(targets, copier=BucketCopier("triton")))


def lenient_receiver(conn, targets):
    receive_forever(conn, make_transport("shm"), TargetLoader(targets, strict=False))


class PublishingLoader(TargetLoader):
    """Records each published version with the number of buckets loaded since the last one (shared
    ``published``: ``[count, version, buckets]`` as int64, versions being integers here)."""

    def __init__(self, targets, published):
        super().__init__(targets)
        self.published, self.buckets = published, 0

    def load_bucket(self, flat, layout, acc, row_stride=1):
        super().load_bucket(flat, layout, acc, row_stride)
        self.buckets += 1

    def publish_version(self, version):
        self.published[:] = torch.tensor([self.published[0] + 1, int(version), self.buckets])
        self.buckets = 0


def publishing_receiver(conn, targets, published):
    receive_forever(conn, make_transport("shm"), PublishingLoader(targets, published))


class RefusingLoader(TargetLoader):
    def publish_version(self, version):
        raise ValueError(f"version {version} refused")


def refusing_receiver(conn, targets):
    receive_forever(conn, make_transport("shm"), RefusingLoader(targets))
