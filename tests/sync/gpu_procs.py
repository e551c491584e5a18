"""Engine-side processes for the GPU sync tests (spawned: CUDA does not survive fork)."""

import torch

from redline.sync.receiver import TargetLoader, make_transport, receive_forever


def ipc_target_receiver(conn, specs):
    """An engine process: its weights are GPU tensors of ``specs``; it hands them to the parent over CUDA IPC
    (so the test can read them), then serves syncs into them."""
    targets = {name: torch.zeros(shape, dtype=dtype, device="cuda") for name, shape, dtype in specs}
    conn.send(targets)
    receive_forever(conn, make_transport("cuda-ipc"), TargetLoader(targets))
