"""Where a colocated SGLang push spends its time: the same model pushed through redline's checked loader and through
``flattened_bucket`` + ``/weights_checker``, each push and each bucket timed, in one sitting on one GPU.

    python benchmarks/sglang_push_probe.py MODEL_DIR OUT.json [--shape qwen3-1.7b] [--pushes 5] [--bucket-mib 512]

MODEL_DIR: an HF model folder (safetensors), made there from the built-in ``--shape`` (random bf16 weights) when it
holds none; the pushes send its own weights back (bf16 on the GPU). Per push: the whole push, SGLang's handling
in it (the engine's ``handling_seconds``: the wait on the servers' answers) and whether it was checked in the load.
Needs SGLang.
"""

import argparse
import asyncio
import json
import time

from pathlib import Path

import torch
from safetensors.torch import load_file

from redline.loop.builtin import builtin_model
from redline.loop.weight_sync import SAMPLED_ROW_STRIDE
from redline.rollout.sglang.engine import SGLangEngine
from redline.sync.plan import named_buckets, plan_for


async def push(engine, buckets, version, check):
    start, handled = time.perf_counter(), engine.handling_seconds
    await engine.update_weights(buckets, version)
    pushed, handled_push = time.perf_counter(), engine.handling_seconds
    if not engine.last_push_checked:
        await engine.verify_weights(check)
    return {"update_ms": (pushed - start) * 1e3, "update_sglang_ms": (handled_push - handled) * 1e3,
            "total_ms": (time.perf_counter() - start) * 1e3,
            "total_sglang_ms": (engine.handling_seconds - handled) * 1e3, "checked_in_load": engine.last_push_checked}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--shape", default="qwen3-1.7b", help="built-in model made in MODEL_DIR when it is empty")
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=512)
    args = parser.parse_args()
    if not (Path(args.model_dir) / "config.json").is_file():
        builtin_model(Path(args.model_dir), args.shape, dtype=torch.bfloat16, device="cuda")
        torch.cuda.empty_cache()
    weights = {}
    for f in sorted(Path(args.model_dir).glob("*.safetensors")):
        weights.update({k: v.to("cuda", torch.bfloat16) for k, v in load_file(f).items()})
    export = list(weights.items())
    plan = plan_for(export, args.bucket_mib << 20)
    engine = SGLangEngine.launch(args.model_dir, sglang_args=["--sglang-mem-fraction-static", "0.3"],
                                 log_dir=args.out + ".logs")
    loop = asyncio.new_event_loop()
    results = {"buckets": len(plan.buckets), "bytes": sum(t.numel() * 2 for t in weights.values())}
    try:
        for mode in ("checked", "weights_checker", "checked"):
            engine.checked_loads = mode == "checked"
            engine.checksum_row_stride = SAMPLED_ROW_STRIDE  # the loop's default check
            runs = [loop.run_until_complete(push(engine, list(named_buckets(plan, export)), f"{mode}{i}", export))
                    for i in range(args.pushes)]
            results.setdefault(mode, []).append(runs)
            print(mode, [(round(r["total_ms"], 1), round(r["total_sglang_ms"], 1)) for r in runs], flush=True)
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
