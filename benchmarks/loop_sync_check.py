"""Helpers of ``benchmarks/loop_sync_check.sh`` (issue 16's colocated-sync acceptance, from the loop's own metrics).

    python benchmarks/loop_sync_check.py model DIR NAME        # the built-in model NAME as an HF folder in DIR
    python benchmarks/loop_sync_check.py copy DIR OUT.json     # one contiguous D2D copy of the model's sync bytes
    python benchmarks/loop_sync_check.py summary OUTDIR        # per-step table of every run + targets -> summary.md

``copy`` loads the model the way the trainer does, plans its buckets like ``redline train``
(``--update-weight-buffer-size`` 512 MiB) and times one ``copy_`` of that many bytes between two flat buffers on
the same device (CUDA events, median of 20 after 3 warm-ups; the CPU's wall clock on a CPU machine).
``summary`` reads ``OUTDIR/<run>/metrics.jsonl`` for every run folder: ``perf/update_weights_time`` and its
parts (``perf/resume_weights_time``, ``perf/sync_time``, ``perf/check_weights_time``, ``perf/resume_kv_time``)
and ``perf/release_time`` per step, and the sync phase over the copy; the targets (sync phase ≤ 2× the copy,
``perf/update_weights_time`` ≤ 15 ms) are judged on the median of the steps after the first (warm-up).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

BUCKET_BYTES = 512 * 2**20
SYNC_TARGET_RATIO, UPDATE_TARGET_S = 2.0, 0.015
COLUMNS = ("perf/update_weights_time", "perf/resume_weights_time", "perf/sync_time", "perf/check_weights_time",
           "perf/resume_kv_time", "perf/release_time")


def make_model(folder: str, name: str) -> None:
    from redline.loop.builtin import builtin_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    builtin_model(Path(folder), name, dtype=torch.bfloat16, device=device)


def copy_time(model_dir: str, out: str) -> None:
    from redline.sync.plan import plan_for
    from redline.trainer.models import from_pretrained

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = from_pretrained(model_dir, backend="bf16", dtype=torch.bfloat16, device=device)
    nbytes = plan_for(model.export_hf(), BUCKET_BYTES).nbytes
    del model
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - began
        if i >= 3:
            times.append(seconds)
    assert torch.equal(dst, src)
    result = {"nbytes": nbytes, "copy_s": statistics.median(times), "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    Path(out).write_text(json.dumps(result) + "\n")
    print(f"contiguous copy of {nbytes / 1e6:.1f} MB on {result['device_name']}: {result['copy_s'] * 1e3:.3f} ms")


def summary(outdir: str) -> int:
    root = Path(outdir)
    copy = json.loads((root / "copy.json").read_text())
    intro = (f"Model sync bytes {copy['nbytes'] / 1e6:.1f} MB; one contiguous device-to-device copy of them "
             f"{copy['copy_s'] * 1e3:.3f} ms (median of 20, same run). Targets: sync phase ≤ "
             f"{SYNC_TARGET_RATIO:g}× the copy, `perf/update_weights_time` ≤ {UPDATE_TARGET_S * 1e3:g} ms "
             "(medians of the steps after the first).")
    lines = [f"# Colocated sync in `redline train` ({copy['device_name']})", "", intro, ""]
    failed = False
    for metrics in sorted(root.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        rows = [r for r in rows if "perf/update_weights_time" in r]
        run = metrics.parent.name
        log = root / f"{run}.log"
        path = next((line.strip() for line in log.read_text().splitlines() if "weight sync:" in line), "") \
            if log.exists() else ""
        header = "| step | " + " | ".join(c.removeprefix("perf/") + " (ms)" for c in COLUMNS) + " | sync / copy |"
        lines += [f"## {run}", "", f"`{path}`", "", header, "| ---: |" + " ---: |" * (len(COLUMNS) + 1)]
        for r in rows:
            cells = [f"{r[c] * 1e3:.2f}" if c in r else "–" for c in COLUMNS]
            ratio = f"{r['perf/sync_time'] / copy['copy_s']:.2f}×" if "perf/sync_time" in r else "–"
            lines.append(f"| {r['step']} | " + " | ".join(cells) + f" | {ratio} |")
        steady = rows[1:] or rows
        update = statistics.median(r["perf/update_weights_time"] for r in steady)
        sync = statistics.median(r.get("perf/sync_time", float("nan")) for r in steady)
        ok_sync, ok_update = sync <= SYNC_TARGET_RATIO * copy["copy_s"], update <= UPDATE_TARGET_S
        failed |= not (ok_sync and ok_update)
        verdict = (f"median after the first step: update_weights {update * 1e3:.2f} ms "
                   f"({'met' if ok_update else 'MISSED'}), sync {sync * 1e3:.2f} ms = "
                   f"{sync / copy['copy_s']:.2f}× the copy ({'met' if ok_sync else 'MISSED'})")
        if all("perf/gpu_mem_gb" in r for r in steady):  # NVML, the whole GPU: the engine process included
            verdict += f"; GPU memory in use {statistics.median(r['perf/gpu_mem_gb'] for r in steady):.2f} GB"
        lines += ["", verdict, ""]
    text = "\n".join(lines) + "\n"
    (root / "summary.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "model":
        make_model(*args)
    elif command == "copy":
        copy_time(*args)
    elif command == "summary":
        sys.exit(summary(*args))
    else:
        sys.exit(f"unknown command {command!r}: model | copy | summary")
