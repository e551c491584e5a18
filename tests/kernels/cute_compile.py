"""Compile the CuTe-DSL LM-head GEMMs (``redline.kernels.lm_head_cute_epilogues`` in QuACK's GEMMs, with
``lm_head_gemm_cute.CONFIGS``) for one architecture without a GPU, and print, as JSON, which variant compiled.

    CUTE_DSL_ARCH=sm_100a python3 tests/kernels/cute_compile.py 10.0

CUTLASS's DSL lowers against symbolic tensors and its own NVVM/ptxas, so only QuACK's two queries of the device
(its capability and how many clusters fit) are answered here. ``tests/kernels/test_lm_head_cute_compile.py`` runs
it per architecture, each in a process of its own (the DSL reads CUTE_DSL_ARCH once).
"""

import json
import sys
import time

import torch


def compile_variants(capability: tuple[int, int]) -> dict:
    import quack.cute_dsl_utils
    import quack.epilogue.frontend
    import quack.gemm_runtime.host

    for module in (quack.cute_dsl_utils, quack.epilogue.frontend):
        module.get_device_capacity = lambda device=None: capability
    quack.gemm_runtime.host.get_max_active_clusters = lambda cluster_size: 132 // cluster_size

    from redline.kernels import lm_head_cute_epilogues as epilogues
    from redline.kernels.lm_head_gemm_cute import CONFIGS, STATS_BLOCK_N

    rows, width, vocab = 512, 256, 4 * STATS_BLOCK_N
    hidden = torch.zeros(rows, width, dtype=torch.bfloat16)
    weight = torch.zeros(vocab, width, dtype=torch.bfloat16)
    pieces = torch.zeros(rows, vocab // STATS_BLOCK_N)
    per_row = dict(target=torch.zeros(rows, dtype=torch.int64), target_logit=torch.zeros(rows))
    stats_args = dict(piece_max=STATS_BLOCK_N, piece_max_out=pieces, sum_exp=pieces.clone(),
                      sum_exp_offset=pieces.clone(), inv_temp=1.0, **per_row)
    dz_args = dict(lse_log2=torch.zeros(1, rows), alpha=torch.zeros(1, rows), beta=torch.zeros(1, rows),
                   scale_log2=1.0, **per_row)
    config = CONFIGS[capability]
    variants = {
        "stats": lambda: epilogues.stats.gemm(hidden, weight, None, epi_args=stats_args, **config["stats"],
                                              _launch=False),
        "stats+offsets": lambda: epilogues.stats.gemm(hidden, weight, torch.zeros(rows, vocab, dtype=torch.float16),
                                                      epi_args=stats_args, **config["stats"], _launch=False),
        "dz": lambda: epilogues.dz.gemm(hidden, weight, torch.zeros(rows, vocab, dtype=torch.bfloat16),
                                        epi_args=dz_args, **config["dz"], _launch=False),
    }
    report = {}
    for name, build in variants.items():
        start = time.perf_counter()
        try:
            build()
            report[name] = {"compiled": True, "seconds": round(time.perf_counter() - start, 1)}
        except Exception as exc:  # reported, with the DSL's message, to the test
            report[name] = {"compiled": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    return report


if __name__ == "__main__":
    major, minor = map(int, sys.argv[1].split("."))
    print(json.dumps(compile_variants((major, minor))))
