"""``cuda_time_ms``: the median CUDA-event time of a call, the timing the benchmark scripts share."""

import torch


def cuda_time_ms(fn, rounds: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``rounds`` calls after ``warmup`` untimed ones, each call timed by
    CUDA events on the current stream and synchronised before the next."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
