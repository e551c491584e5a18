"""The run folder (``--output-dir``): one run per folder, and a failed start leaves it as it was found.

A folder holding a previous run (any of ``RUN_MARKERS``) is used again only by a run that resumes it (``--load``
of a checkpoint inside it, which keeps its records up to the checkpoint's step) or with ``--overwrite``, which
empties it once the start has validated; otherwise the start is refused. Mixing two runs in one folder would let
a later ``--load`` pick up the other run's checkpoints and TensorBoard show both.
"""

import shlex
import shutil
from pathlib import Path

from redline.configfile import ConfigError

RUN_MARKERS = ("metrics.jsonl", "checkpoints", "tensorboard", "config.toml", "report.md")


def holds_a_run(out: Path) -> bool:
    return any((Path(out) / name).exists() for name in RUN_MARKERS)


def resumes(out: Path, load: str | None) -> bool:
    """True when ``--load`` names a checkpoint inside ``out`` (the run continues in its own folder)."""
    from redline.loop.checkpoint import resolve

    if not load:
        return False
    try:
        return resolve(load).resolve().is_relative_to(Path(out).resolve())
    except (FileNotFoundError, ValueError) as exc:  # no checkpoint there, or one of the refused pickle format
        raise ConfigError(str(exc)) from None


def previous_run(out: Path, load: str | None, overwrite: bool) -> list[str]:
    """The entries of another run in ``out`` that this run replaces (``--overwrite``; removed with ``discard``
    once the start has validated), [] for a new folder or a resumed one; a used folder without ``--overwrite``
    is refused. ``builtin/`` is left out: the start writes it again."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out}: not a directory")
    if not holds_a_run(out) or resumes(out, load):
        return []
    if not overwrite:
        raise ConfigError(f"--output-dir {out} holds a previous run; resume it with --load {out}, pass --overwrite "
                          f"to replace it, or choose another --output-dir")
    return sorted(p.name for p in out.iterdir() if p.name != "builtin")


def discard(out: Path, names: list[str]) -> None:
    for name in names:
        _remove(Path(out) / name)


def contents(out: Path) -> list[str] | None:
    """The names in ``out`` now (None: it does not exist), for ``undo_start``."""
    out = Path(out)
    return sorted(p.name for p in out.iterdir()) if out.is_dir() else None


def undo_start(out: Path, before: list[str] | None) -> None:
    """Remove what a failed start added: the whole folder if it did not exist, else the entries that are new."""
    out = Path(out)
    if not out.is_dir():
        return
    if before is None:
        shutil.rmtree(out)
        return
    for entry in out.iterdir():
        if entry.name not in before:
            _remove(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def resume_command(out: Path, world: int = 1) -> str:
    """The command that resumes the run in ``out`` from its latest checkpoint: its own ``config.toml`` (the whole
    resolved configuration), the folder, and ``--load`` of it."""
    launcher = f"torchrun --standalone --nproc-per-node {world} -m redline.cli" if world > 1 else "redline"
    folder = shlex.quote(str(out))
    return f"{launcher} train {shlex.quote(str(Path(out) / 'config.toml'))} --output-dir {folder} --load {folder}"
