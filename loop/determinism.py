"""Same seed, same machine, same result: a CPU run is bit-identical from one launch to the next.

What makes it so: every sample draws from its own generator seeded from ``--seed`` and its index
(``rollout_setup.seeded``); the embedded engine queues the requests of one rollout or evaluation together, so its
prefill batches do not depend on thread timing (``EmbeddedEngine._queue_arrivals``); the rollout keeps its groups
in draw order, not completion order (``RolloutManager._collect``), so the trainer sees the same batches; and on a
machine without CUDA, ``deterministic_algorithms`` has torch pick deterministic kernels for the run.

What is not promised: another machine or another ``torch.get_num_threads()`` (CPU GEMMs block and reduce by
thread count and instruction set); GPU runs (atomics in some kernels, cuBLAS and autotuning choices, SGLang's
scheduling); a dynamic sampling filter with over-sampling (which groups finish first decides which are kept);
custom generate functions that await something before calling the engine, and the engine in its own process
(``--embedded-engine-process``), whose requests reach it one message at a time.
"""

import contextlib

import torch


@contextlib.contextmanager
def deterministic_algorithms():
    """Within the block, on a machine without CUDA: ``torch.use_deterministic_algorithms(True)`` (warn only,
    for an op without a deterministic kernel); the previous setting is restored after it. GPU runs keep torch's
    defaults: the deterministic CUDA kernels cost speed and need ``CUBLAS_WORKSPACE_CONFIG`` set at launch."""
    if torch.cuda.is_available():
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
