"""Receiver processes for the protocol tests (entry points must be importable by the child process)."""

import os
import time

import torch

from redline.sync.receiver import TargetLoader, make_transport, receive_forever


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


def shared_zeros_like(named_tensors):
    """``{name: zeros}`` in shared memory, visible to the parent after the child writes them."""
    return {n: torch.zeros_like(t).share_memory_() for n, t in named_tensors}
