"""What a new sequence length costs causal SDPA, per backend: the first fwd+bwd call at each of 20 new lengths
against a repeat at the same length (the per-shape plan cuDNN builds shows as the difference).

    python benchmarks/sdpa_first_call.py OUT     # one CUDA GPU; writes OUT/sdpa_first_call.{json,md}

Batch 60 sequences × 16 heads × head dim 128, bf16, lengths 130–209 (each backend its own 20, so no backend meets
a shape another one planned).
"""

import argparse
import contextlib
import datetime
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM, SEQUENCES, LENGTHS_PER_BACKEND = 16, 128, 60, 20
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def fwd_bwd_seconds(length: int) -> float:
    q, k, v = (torch.randn(SEQUENCES, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    began = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - began


def measure(index: int, backend) -> dict:
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        fwd_bwd_seconds(64)  # the backend's own one-time start
        lengths = range(130 + LENGTHS_PER_BACKEND * index, 130 + LENGTHS_PER_BACKEND * (index + 1))
        firsts, repeats = zip(*[(fwd_bwd_seconds(n), fwd_bwd_seconds(n)) for n in lengths])
    return {"first_call_ms": 1e3 * sum(firsts) / len(firsts), "repeat_ms": 1e3 * sum(repeats) / len(repeats),
            "lengths": [lengths.start, lengths.stop - 1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    rows = {name: measure(i, backend) for i, (name, backend) in enumerate(BACKENDS.items())}
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version(), "date": datetime.date.today().isoformat(),
              "shape": {"sequences": SEQUENCES, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
              "backends": rows}
    (out / "sdpa_first_call.json").write_text(json.dumps(record, indent=1))
    lines = [f"# Causal SDPA: first call at a new length vs repeat ({record['device']}, torch {record['torch']}, "
             f"cuDNN {record['cudnn']}, {record['date']})", "",
             f"fwd+bwd, {SEQUENCES} sequences × {HEADS} heads × {HEAD_DIM}, bf16; mean over "
             f"{LENGTHS_PER_BACKEND} new lengths per backend", "", "| backend | first call (ms) | repeat (ms) |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {r['first_call_ms']:.2f} | {r['repeat_ms']:.2f} |" for name, r in rows.items()]
    (out / "sdpa_first_call.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
