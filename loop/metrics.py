"""What the user sees of a run: metrics.jsonl, TensorBoard events, PNG plots and a markdown report.

One record per rollout step, keyed with slime-style names (``rollout/reward_mean``, ``train/pg_loss``,
``perf/step_time`` ...) plus ``step``.
"""

import json
import math
import warnings
from pathlib import Path

PHASES = ("perf/rollout_time", "perf/offload_rollout_time", "perf/logprob_time", "perf/train_time",
          "perf/update_weights_time", "perf/idle_time")  # they add up to perf/step_time
# The colocated transition (pause train → resume engine weights → sync → resume KV cache → generate → release →
# resume train) inside the phases above: a phase's parts stack in its place in phase_times.png and are listed
# under it in the report; what the phase holds beyond them shows as "<phase>: other".
PHASE_PARTS = {
    "perf/offload_rollout_time": ("perf/release_time", "perf/resume_train_time"),
    "perf/update_weights_time": ("perf/pause_train_time", "perf/resume_weights_time", "perf/sync_time",
                                 "perf/check_weights_time", "perf/resume_kv_time"),
}
# An async step (--async-rollout) generates while it trains: its rollout phase is the trainer's wait for the
# batch (perf/train_wait_time), and perf/rollout_time the engines' generating time, which overlaps the others.
OVERLAPPED = {"perf/rollout_time": "perf/train_wait_time"}
PHASE_PLOT = "phase_times.png"  # stacked seconds per phase (phase_segments), drawn apart from PLOTS
PLOTS = {
    "reward.png": ("rollout/reward_mean", "eval/reward_mean"),
    "kl.png": ("train/kl", "train/approx_kl"),
    "entropy.png": ("train/entropy",),
    # GPU telemetry (redline.gpu_telemetry): drawn only when the run sampled a GPU
    "gpu_util.png": ("perf/gpu_util",),
    "gpu_memory.png": ("perf/gpu_mem_gb",),
    "gpu_power.png": ("perf/gpu_power_w",),
    "gpu_sm_clock.png": ("perf/gpu_sm_clock_mhz",),
    # colocated on a GPU (redline.loop.weight_sync): what --offload-train leaves on the GPU, what the KV cache gets
    "colocated_memory.png": ("perf/trainer_paused_bytes", "perf/kv_headroom_bytes"),
}
# title and y-axis label (with its unit) of each plot; the x axis is always the rollout step
PLOT_AXES = {
    "reward.png": ("Mean reward per sample: rollouts and evaluation", "reward"),
    "kl.png": ("KL divergence to the reference (kl) and to the rollout policy (approx_kl)", "nats per token"),
    "entropy.png": ("Policy entropy over response tokens", "nats per token"),
    "gpu_util.png": ("GPU utilisation", "% of time busy"),
    "gpu_memory.png": ("GPU memory used", "GB"),
    "gpu_power.png": ("GPU power draw", "W"),
    "gpu_sm_clock.png": ("GPU SM clock", "MHz"),
    "colocated_memory.png": ("GPU memory of the paused trainer, and free as the engine resumes its KV cache",
                             "bytes"),
}


def short(key: str) -> str:
    return key.removeprefix("perf/").removesuffix("_time")


def phase_key(key: str, record: dict) -> str:
    """The record's key for the phase ``key``: its ``OVERLAPPED`` stand-in when the record has one."""
    return OVERLAPPED[key] if key in OVERLAPPED and OVERLAPPED[key] in record else key


def phase_segments(record: dict) -> list[tuple[str, float]]:
    """``(name, seconds)`` stacking up to the record's ``perf/step_time``: each phase of ``PHASES``, or where the
    record has parts of it (``PHASE_PARTS``), those parts and ``"<phase>: other"``, the rest of the phase."""
    segments = []
    for key in PHASES:
        key = phase_key(key, record)
        total = record.get(key, 0.0)
        parts = [(short(p), record[p]) for p in PHASE_PARTS.get(key, ()) if p in record]
        if parts:
            segments += parts + [(f"{short(key)}: other", max(total - sum(s for _, s in parts), 0.0))]
        else:
            segments.append((short(key), total))
    return segments


def read_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``. An incomplete last line (a process killed mid-append) is dropped with
    a warning; a bad line elsewhere raises ValueError naming the file and line."""
    lines = Path(path).read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON record ({exc})") from None
            warnings.warn(f"{path}:{number}: dropped an incomplete last record (the run writing it was killed "
                          f"mid-write)", stacklevel=2)
    return records


class MetricsLog:
    """Appends step records to ``metrics.jsonl`` and TensorBoard; draws plots and the report on ``close``."""

    def __init__(self, output_dir: Path, use_wandb: bool = False, run_name: str = "run", config: dict | None = None,
                 resume_step: int | None = None):
        """``resume_step``: the step of the checkpoint a resumed run continues from; the records up to it are kept,
        later ones (written after the checkpoint by the run that stopped) dropped, in ``metrics.jsonl`` and in
        TensorBoard (a purge of the later steps). None: a fresh record."""
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        purge = None if resume_step is None else resume_step + 1
        self.tensorboard = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=purge)
        self.records = read_records(self.path) if self.path.exists() else []
        self.truncate_after(-1 if resume_step is None else resume_step)
        self.wandb = None
        if use_wandb:
            from redline.extras import require

            self.wandb = require("wandb", "--use-wandb")
            self.wandb.init(project="redline", name=run_name, config=config or {}, dir=str(self.dir))

    def truncate_after(self, step: int) -> None:
        """Forget records past ``step`` (a resumed run redoes them)."""
        self.records = [r for r in self.records if r["step"] <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.records = [r for r in self.records if r["step"] != step] + [record]
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in metrics.items():
            if math.isfinite(float(value)):
                self.tensorboard.add_scalar(key, float(value), step)
        self.tensorboard.flush()
        if self.wandb:
            self.wandb.log(record, step=step)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in sorted(self.records, key=lambda r: r["step"]) if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    def plot(self) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        written = []
        for name, keys in PLOTS.items():
            fig, ax = plt.subplots(figsize=(6, 3.5))
            drawn = False
            for key in keys:
                steps, values = self.series(key)
                if any(v != 0 for v in values):  # a metric that is identically zero says nothing drawn
                    ax.plot(steps, values, marker="o", markersize=3, label=key)
                    drawn = True
            if not drawn:
                plt.close(fig)
                continue
            title, unit = PLOT_AXES.get(name, (name.removesuffix(".png"), ""))
            ax.set_title(title, fontsize=10)
            ax.set_ylabel(unit)
            ax.set_xlabel("rollout step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(self.dir / name, dpi=100)
            plt.close(fig)
            written.append(self.dir / name)
        rows = sorted((r for r in self.records if "perf/step_time" in r), key=lambda r: r["step"])
        if rows:
            written.append(self._plot_phases(plt, rows))
        return written

    def _plot_phases(self, plt, rows: list[dict]) -> Path:
        """Seconds per phase of every step, stacked (the transition's parts in place of their phase)."""
        per_step = [dict(phase_segments(r)) for r in rows]
        names = list(dict.fromkeys(name for segments in per_step for name in segments))
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.stackplot([r["step"] for r in rows], [[s.get(n, 0.0) for s in per_step] for n in names], labels=names)
        ax.set_title("Step time by phase", fontsize=10)
        ax.set_xlabel("rollout step")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        fig.savefig(self.dir / PHASE_PLOT, dpi=100)
        plt.close(fig)
        return self.dir / PHASE_PLOT

    def report(self, title: str, notes: list[str]) -> Path:
        """A short markdown summary: first/last/best of the headline metrics, timings, and the plots."""
        lines = [f"# {title}", "", *notes, "",
                 "| metric | first | last | min | max |", "| --- | ---: | ---: | ---: | ---: |"]
        keys = sorted({k for r in self.records for k in r if k != "step"})
        for key in keys:
            _, values = self.series(key)
            if values:
                lines.append(f"| {key} | {values[0]:.4g} | {values[-1]:.4g} | {min(values):.4g} | {max(values):.4g} |")
        lines += self.breakdown()
        lines += ["", *(f"![{p.stem}]({p.name})" for p in self.plot())]
        path = self.dir / "report.md"
        path.write_text("\n".join(lines) + "\n")
        return path

    def breakdown(self) -> list[str]:
        """Markdown table of the mean seconds and share of the step per phase; the first RL step (warm-up:
        CUDA graphs, autotuning, allocator growth) is left out when there are others."""
        rows = sorted((r for r in self.records if "perf/step_time" in r), key=lambda r: r["step"])
        if len(rows) > 1:
            rows = rows[1:]
        if not rows:
            return []
        step = sum(r["perf/step_time"] for r in rows) / len(rows)
        lines = ["", f"Step-time breakdown, mean of steps {rows[0]['step']}–{rows[-1]['step']}:", "",
                 "| phase | seconds | share |", "| --- | ---: | ---: |"]
        mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)
        for key in PHASES:
            key = phase_key(key, rows[-1])
            lines.append(f"| {short(key)} | {mean(key):.4f} | {mean(key) / step:.1%} |")
            for part in PHASE_PARTS.get(key, ()):
                if any(part in r for r in rows):
                    lines.append(f"| {short(key)}: {short(part)} | {mean(part):.4f} | {mean(part) / step:.1%} |")
        lines.append(f"| step | {step:.4f} | 100% |")
        return lines

    def close(self) -> None:
        """Every record on disk when it returns: TensorBoard's events and, with W&B, its run finished and its
        writer process stopped (after ``finish`` alone, one CI run found an offline run's file holding only its
        header; not reproduced since)."""
        self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
            self.wandb.teardown()
