"""What the console shows while a run trains.

On a terminal: a live rich display at the bottom — the overall bar over the RL steps with elapsed time and ETA,
and the phase now running (rollout, log-probs, train, sync, eval) — under the scrolling step lines, the last of
which is the last step's. Elsewhere (a log file, a pipe): one unwrapped line per step and nothing that redraws.
Evaluations are printed when they are computed, warnings (``redline.loop.health``) in bold red, and the run
ends with a summary line.
"""

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RunProgress:
    """``with RunProgress(console, total, done):`` around the loop; ``phase`` names what runs now, ``step``
    prints a step's line and advances the bar."""

    def __init__(self, console: Console, total: int, done: int = 0):
        self.console = console
        self.live = None
        if console.is_terminal and not console.quiet:
            self.live = Progress(TextColumn("[bold]RL steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("· {task.fields[phase]}"),
                                 console=console)
            self.task = self.live.add_task("steps", total=total, completed=done, phase="starting")

    def __enter__(self):
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.stop()

    def begin(self, done: int) -> None:
        """The loop starts after ``done`` steps (a resumed run): the bar and its ETA count from there."""
        if self.live:
            self.live.reset(self.task, completed=done, phase="starting")

    def phase(self, name: str) -> None:
        if self.live:
            self.live.update(self.task, phase=name)

    def print(self, line: str, style: str | None = None) -> None:
        """A line above the live display (or a plain unwrapped line without one)."""
        self.console.print(line, style=style, markup=False, highlight=False, soft_wrap=True)

    def step(self, line: str) -> None:
        self.print(line)
        if self.live:
            self.live.advance(self.task)

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        values = {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")}
        if values:
            self.print(f"eval at step {step}: " + " · ".join(f"{k} {v:.3f}" for k, v in values.items()), "bold")

    def warn(self, message: str) -> None:
        self.print(f"WARNING {message}", "bold red")


def summary(records: list[dict], steps: int, seconds: float, report) -> str:
    """One line: how many steps in how long, the eval reward before → after (when evaluated), the report."""
    evals = [(r["step"], r["eval/reward_mean"]) for r in sorted(records, key=lambda r: r["step"])
             if "eval/reward_mean" in r]
    parts = [f"done: {steps} RL steps in {seconds:.1f} s"]
    if evals:
        (first_step, first), (last_step, last) = evals[0], evals[-1]
        parts.append(f"eval reward {first:.3f} (step {first_step}) → {last:.3f} (step {last_step})")
    parts.append(f"report {report}")
    return " · ".join(parts)
