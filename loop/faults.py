"""Fault injection for tests of fault tolerance: ``REDLINE_FAULT`` names the faults; inert unless it is set.

``REDLINE_FAULT`` is a comma-separated list of

* ``kill-engine:K@rollout:R`` — during rollout ``R`` (the rollout id, 0-based: ``checkpoints/rollout_R``; its
  record in ``metrics.jsonl`` is step R + 1), SIGKILL the process of engine ``K`` of every trainer rank as soon as
  one of its requests has come back (the others still in flight). Needs fault tolerance over engine processes
  (``--use-fault-tolerance`` with ``--embedded-engine-process``, or ``--ray-address``).
* ``kill-trainer:RANK@step:S`` — trainer rank ``RANK`` SIGKILLs itself right after step ``S`` is logged, before
  that step's checkpoint (if any) is written: ``--auto-resume`` then has logged records past its last checkpoint
  to drop.

Faults fire in the first attempt of a run only: the Ray launcher sets ``REDLINE_ATTEMPT`` for each restart, so a
resumed run does not die again at the same step.
"""

import os
import re
import signal
from dataclasses import dataclass

FAULT_ENV = "REDLINE_FAULT"
ATTEMPT_ENV = "REDLINE_ATTEMPT"
_PATTERN = re.compile(r"(kill-engine|kill-trainer):(\d+)@(rollout|step):(\d+)")
_UNIT = {"kill-engine": "rollout", "kill-trainer": "step"}


@dataclass(frozen=True)
class Fault:
    kind: str  # kill-engine | kill-trainer
    target: int  # engine index | trainer rank
    at: int  # rollout id | step


def planned() -> list[Fault]:
    """The faults ``REDLINE_FAULT`` names ([] when unset, or in a restarted attempt); ValueError for a bad entry."""
    text = os.environ.get(FAULT_ENV, "").strip()
    if not text or int(os.environ.get(ATTEMPT_ENV, "0")) > 0:
        return []
    faults = []
    for entry in text.split(","):
        match = _PATTERN.fullmatch(entry.strip())
        if not match or _UNIT[match[1]] != match[3]:
            raise ValueError(f"{FAULT_ENV}: {entry!r} is not kill-engine:K@rollout:R or kill-trainer:RANK@step:S")
        faults.append(Fault(match[1], int(match[2]), int(match[4])))
    return faults


def engine_to_kill(rollout_id: int) -> int | None:
    """The engine index ``REDLINE_FAULT`` kills during rollout ``rollout_id``, or None."""
    return next((f.target for f in planned() if f.kind == "kill-engine" and f.at == rollout_id), None)


def after_step(rank: int, step: int) -> None:
    """Called by the loop once step ``step`` is logged: SIGKILL this process when ``REDLINE_FAULT`` says so."""
    if any(f.kind == "kill-trainer" and f.target == rank and f.at == step for f in planned()):
        os.kill(os.getpid(), signal.SIGKILL)
