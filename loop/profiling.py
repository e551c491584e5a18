"""``--use-pytorch-profiler``: a ``torch.profiler`` trace of chosen RL steps, and what the GPU did in each phase.

Steps ``--profile-step-start`` .. ``--profile-step-end - 1`` (numbered as in metrics.jsonl) are recorded in one
trace per process. Each step is a ``redline/step`` range and each of its phases a ``redline/<phase>`` range
(``rollout``, ``offload_rollout``, ``logprob``, ``train``, ``update_weights``: the ``perf/*`` phases, whose ends
synchronise the device, so a phase's GPU work runs inside its range). Written to ``<run>/profile/rank<R>/``:

* ``trace.json.gz``: the Chrome trace (open it in https://ui.perfetto.dev);
* ``summary.json`` and ``summary.md`` (``summarize_trace``): per phase and GPU, per profiled step, the phase's
  wall seconds, the seconds a kernel, copy or memset ran (``busy``) and the idle share of the phase, the seconds
  of NCCL kernels and of those not overlapped by any other kernel (``exposed``), device copies, kernel launches,
  and the phase's heaviest kernels.

Profiled steps carry ``perf/profiled = 1`` in metrics.jsonl: tracing slows the host, so their times are not the
run's. Engines in processes of their own (the embedded engine process, SGLang) are not in the trace. An SFT-only
run (``--loss-type sft``) has no phases: its summary holds the ``step`` range alone.
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections import defaultdict
from pathlib import Path

import torch

PREFIX = "redline/"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories that occupy a GPU
TOP_KERNELS = 5


class StepProfiler:
    """Starts ``torch.profiler`` at the first of ``steps``, marks steps and phases, and after the last one (or at
    ``close``, after a failure) writes the trace and its summary into ``folder``. No steps: inert."""

    def __init__(self, steps: range = range(0), folder: Path | None = None):
        self.steps = steps
        self.folder = folder
        self.profiled: list[int] = []
        self.summary_path: Path | None = None  # written by ``finish``
        self._profiler = None
        self._ranges: list[torch.profiler.record_function] = []  # the open step range, then its phase range

    @classmethod
    def for_run(cls, profile_config, out: Path, rank: int) -> StepProfiler:
        """The run's profiler (``[profile]`` settings), writing into ``out/profile/rank<rank>``."""
        if not profile_config.use_pytorch_profiler:
            return cls()
        return cls(range(profile_config.profile_step_start, profile_config.profile_step_end),
                   Path(out) / "profile" / f"rank{rank}")

    def begin_step(self, step: int) -> None:
        if step not in self.steps:
            return
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
        self._open(PREFIX + "step")
        self.profiled.append(step)

    def phase(self, name: str) -> None:
        """Close the step's current phase range, if any, and open ``redline/<name>``."""
        if not self._ranges:
            return
        if len(self._ranges) == 2:
            self._close()
        self._open(PREFIX + name)

    def end_step(self, step: int) -> dict[str, float]:
        """The step's metrics from the profiler: ``{"perf/profiled": 1.0}`` for a profiled step, else none."""
        if not self._ranges:
            return {}
        while self._ranges:
            self._close()
        if step == self.steps[-1]:
            self.finish()
        return {"perf/profiled": 1.0}

    def finish(self) -> Path | None:
        """Stop tracing, write the trace and its summary; returns the summary's markdown path (None when nothing
        was traced)."""
        if self._profiler is None:
            return None
        while self._ranges:
            self._close()
        self._profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace_path = self.folder / "trace.json.gz"
        self._profiler.export_chrome_trace(str(trace_path))
        self._profiler = None
        with gzip.open(trace_path, "rt") as f:
            summary = summarize_trace(json.load(f), steps=len(self.profiled))
        summary["profiled_steps"] = list(self.profiled)
        (self.folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.summary_path = self.folder / "summary.md"
        self.summary_path.write_text(summary_markdown(summary))
        return self.summary_path

    close = finish  # a run that ends early (Ctrl-C, an error) still writes what it traced

    def report_lines(self, out: Path) -> list[str]:
        """The report's line pointing at this process's summary, once written."""
        if self.summary_path is None:
            return []
        return [f"profile of steps {self.profiled}: {self.summary_path.relative_to(out)} (trace: "
                f"{(self.folder / 'trace.json.gz').relative_to(out)})"]

    def _open(self, name: str) -> None:
        span = torch.profiler.record_function(name)
        span.__enter__()
        self._ranges.append(span)

    def _close(self) -> None:
        self._ranges.pop().__exit__(None, None, None)


# ---------------------------------------------------------------- the trace's summary


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length covered by both of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _clip(start: float, end: float, lo: float, hi: float) -> tuple[float, float] | None:
    start, end = max(start, lo), min(end, hi)
    return (start, end) if end > start else None


def is_communication(kernel_name: str) -> bool:
    return "nccl" in kernel_name.lower()


def summarize_trace(trace: dict, steps: int = 1) -> dict:
    """What each ``redline/<phase>`` range of a Chrome trace (``torch.profiler``'s export) held on each GPU, per
    step (totals divided by ``steps``). Device work counts in a phase from where it starts, clipped to the
    phase's end. Returns ``{"steps", "phases": {phase: {"wall_s", "gpus": {device: {"busy_s", "idle_share",
    "nccl_s", "exposed_nccl_s", "copy_s", "kernels"}}, "top_kernels": [{"name", "seconds", "calls"}]}}}``;
    seconds are per step. A trace without GPU work (a CPU run) gives phases with empty ``gpus``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX):
            spans[e["name"][len(PREFIX):]].append((e["ts"], e["ts"] + e["dur"]))
    work = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    starts = [e["ts"] for e in work]
    phases = {}
    for phase, windows in spans.items():
        per_gpu: dict[int, dict[str, list]] = defaultdict(lambda: {"all": [], "nccl": [], "compute": [], "copy": []})
        kernels: dict[int, int] = defaultdict(int)
        heaviest: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for lo, hi in windows:
            for e in work[bisect.bisect_left(starts, lo):bisect.bisect_left(starts, hi)]:
                piece = _clip(e["ts"], e["ts"] + e["dur"], lo, hi)
                if piece is None:
                    continue
                device = int(e.get("args", {}).get("device", 0))
                gpu = per_gpu[device]
                gpu["all"].append(piece)
                if e["cat"] == "kernel":
                    kernels[device] += 1
                    gpu["nccl" if is_communication(e["name"]) else "compute"].append(piece)
                    heaviest[e["name"]][0] += piece[1] - piece[0]
                    heaviest[e["name"]][1] += 1
                else:
                    gpu["copy"].append(piece)
        wall = _length(windows)
        gpus = {}
        for device, kinds in sorted(per_gpu.items()):
            busy, nccl, compute = (_union(kinds[k]) for k in ("all", "nccl", "compute"))
            gpus[str(device)] = {
                "busy_s": _length(busy) / 1e6 / steps, "idle_share": 1 - _length(busy) / wall if wall else 0.0,
                "nccl_s": _length(nccl) / 1e6 / steps,
                "exposed_nccl_s": (_length(nccl) - _overlap(nccl, compute)) / 1e6 / steps,
                "copy_s": _length(_union(kinds["copy"])) / 1e6 / steps, "kernels": kernels[device] / steps}
        top = sorted(heaviest.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
        phases[phase] = {"wall_s": wall / 1e6 / steps, "gpus": gpus,
                         "top_kernels": [{"name": name, "seconds": s / 1e6 / steps, "calls": calls / steps}
                                         for name, (s, calls) in top]}
    return {"steps": steps, "phases": phases}


PHASE_ORDER = ("step", "rollout", "offload_rollout", "logprob", "train", "update_weights")


def summary_markdown(summary: dict) -> str:
    """``summary`` (``summarize_trace``) as tables: phases by GPU, then each phase's heaviest kernels."""
    rank = {phase: i for i, phase in enumerate(PHASE_ORDER)}
    order = sorted(summary["phases"], key=lambda p: (rank.get(p, len(PHASE_ORDER)), p))
    lines = [f"# Profile: what the GPU did per phase (per step, over {summary['steps']} profiled step(s): "
             f"{summary.get('profiled_steps', '')})", "",
             "| phase | wall s | GPU | busy s | idle | NCCL s | NCCL not overlapped s | copies s | kernels |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for phase in order:
        p = summary["phases"][phase]
        rows = p["gpus"].items() or [("—", None)]
        for device, g in rows:
            if g is None:
                lines.append(f"| {phase} | {p['wall_s']:.4f} | — | — | — | — | — | — | — |")
                continue
            lines.append(f"| {phase} | {p['wall_s']:.4f} | {device} | {g['busy_s']:.4f} | {g['idle_share']:.1%} | "
                         f"{g['nccl_s']:.4f} | {g['exposed_nccl_s']:.4f} | {g['copy_s']:.4f} | {g['kernels']:.0f} |")
    for phase in order:
        top = summary["phases"][phase]["top_kernels"]
        if top:
            lines += ["", f"## {phase}: heaviest kernels", "", "| kernel | s per step | calls |", "|---|---:|---:|"]
            lines += [f"| `{k['name'][:100]}` | {k['seconds']:.4f} | {k['calls']:.0f} |" for k in top]
    return "\n".join(lines) + "\n"
