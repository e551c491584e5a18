"""Time QuACK launch configurations of the CuTe-DSL LM-head GEMMs (``redline.kernels.lm_head_gemm_cute``) on the
blocks the default plans give, beside cuBLAS doing the bare GEMM of the same block.

    python3 benchmarks/tune_cute_lm_head.py OUT.json [--tokens 16384] [--hidden 4096] [--vocab 151936]

Per configuration: median ms over 20 calls (after a compiling call and 3 warm-ups) of ``gemm_stats`` on one
forward token chunk (the whole vocabulary), of ``gemm_dz`` on one backward block (and QuACK's plain GEMM of the block
in the same configuration: what the epilogue costs), and of the dz epilogue cut into parts
(``tune_cute_epilogue_parts``: which of its pieces costs the time). sm_90 only.
"""

import argparse
import json
import sys

import torch
from cuda_timing import cuda_time_ms

from redline.env_report import collect
from redline.kernels import lm_head_gemm_cute as cute
from redline.kernels.linear_logprobs_triton import ALIGN, WORKSPACE_BYTES
from redline.kernels.lm_head_plan import backward_plan, forward_plan, round_up

STATS_CONFIGS = [dict(tile_M=m, tile_N=cute.STATS_BLOCK_N, cluster_M=cm, cluster_N=cn, pingpong=pp)
                 for m, pp in ((128, True), (192, True), (256, False)) for cm, cn in ((2, 1), (1, 2))]
DZ_CONFIGS = ([dict(tile_M=128, tile_N=n, cluster_M=2, cluster_N=1, pingpong=True) for n in (128, 192, 208)]
              + [dict(tile_M=256, tile_N=n, cluster_M=2, cluster_N=1, pingpong=False) for n in (128, 192, 208)]
              + [dict(tile_M=128, tile_N=256, cluster_M=cm, cluster_N=cn, pingpong=False)
                 for cm, cn in ((2, 1), (1, 2))])


def _try(fn):
    try:
        return round(cuda_time_ms(fn, rounds=20, warmup=4), 3), None
    except Exception as exc:  # a configuration QuACK refuses is a result, not a crash
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    t, h, v = args.tokens, args.hidden, args.vocab
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device=device, generator=gen) * h ** -0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), device=device, generator=gen)
    results = dict(environment=collect(), tokens=t, hidden=h, vocab=v, stats=[], dz=[])

    tc, _ = forward_plan(t, v, h, False, 2, WORKSPACE_BYTES, ALIGN, piece=cute.STATS_BLOCK_N)
    parts = torch.empty(5, tc, v // cute.STATS_BLOCK_N, device=device)
    logits = torch.empty(tc, v, device=device, dtype=torch.bfloat16)
    results["stats_block"] = [tc, v]
    results["stats_cublas_ms"] = _try(lambda: torch.mm(hidden[:tc], weight.t(), out=logits))[0]
    from quack.epilogue.library import identity_epi

    for config in STATS_CONFIGS:
        cute.CONFIGS[(9, 0)]["stats"] = config
        ms, error = _try(lambda: cute.gemm_stats(hidden[:tc], weight, targets[:tc], parts, 1.0))
        plain, _ = _try(lambda: identity_epi.gemm(hidden[:tc], weight, logits, epi_args={}, **config))
        results["stats"].append(dict(config=config, ms=ms, plain_gemm_ms=plain, error=error))
        print("stats", config, ms, "plain", plain, error, flush=True)

    tc, vc = backward_plan(t, v, h, False, 2, WORKSPACE_BYTES, ALIGN, keeps_logits=False)
    dz = torch.empty(tc, round_up(vc, cute.STRIDE_ALIGN), device=device, dtype=torch.bfloat16)[:, :vc]
    row = torch.rand(tc, device=device)
    row_values = (row + 5, row, row - 0.5, row * 0.1)
    results["dz_block"] = [tc, vc]
    results["dz_cublas_ms"] = _try(lambda: torch.mm(hidden[:tc], weight[:vc].t(), out=dz))[0]
    for config in DZ_CONFIGS:
        cute.CONFIGS[(9, 0)]["dz"] = config
        ms, error = _try(lambda: cute.gemm_dz(hidden[:tc], weight[:vc], dz, targets[:tc], 0, row_values, 1.0))
        plain, _ = _try(lambda: identity_epi.gemm(hidden[:tc], weight[:vc], dz, epi_args={}, **config))
        results["dz"].append(dict(config=config, ms=ms, plain_gemm_ms=plain, error=error))
        print("dz", config, ms, "plain", plain, error, flush=True)

    from tune_cute_epilogue_parts import DZ_PARTS

    results["dz_parts"] = []
    lse_log2, alpha, beta = cute.dz_row_terms(row_values, 1.0)
    operands = dict(lse_log2=lse_log2, alpha=alpha, beta=beta, scale_log2=cute.LOG2E,
                    target=targets[:tc].to(torch.int32), target_logit=torch.empty(tc, device=device))
    for name, (mod, keys) in DZ_PARTS.items():
        epi_args = {key: operands[key] for key in keys}
        ms, error = _try(lambda: mod.gemm(hidden[:tc], weight[:vc], dz, epi_args=epi_args, **DZ_CONFIGS[1]))
        results["dz_parts"].append(dict(epilogue=name, config=DZ_CONFIGS[1], ms=ms, error=error))
        print("dz part", name, ms, error, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
