"""Ranks for test_parallel_options.py: each starts the loop's process groups and checks their config."""

import os
import socket

import torch.distributed as dist

from redline.loop.data_parallel import init_data_parallel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def options_worker(rank, port, kwargs, expected):
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dp = init_data_parallel(1.0, **kwargs)
    try:
        config = dp.state.config
        assert {key: getattr(config, key) for key in expected} == expected
    finally:
        dist.destroy_process_group()
