"""A SIGKILLed launcher does not orphan its embedded engine process: the child dies with its parent."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns a launcher and its engine process (a few seconds)

LAUNCHER = """
import sys, time, torch
from redline.rollout.embedded.process import EmbeddedEngineProcess
engine = EmbeddedEngineProcess(sys.argv[1], dtype=torch.float32, max_batch_size=2, max_seq_len=64)
print(engine._process.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead: it holds no memory)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


WATCHDOG_ONLY = """
import multiprocessing, sys, time


def child():
    sys.platform = "darwin"  # no prctl: the parent watchdog alone, as off Linux
    from redline.rollout.embedded.lifeline import die_with_parent
    die_with_parent()
    time.sleep(600)


if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=child, daemon=True)
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc (Linux)")
def test_sigkill_of_the_launcher_takes_the_engine_process_with_it(model_dir):
    assert_child_dies_with(subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model_dir)], stdout=subprocess.PIPE,
                                            text=True))


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc (Linux)")
def test_the_parent_watchdog_alone_ends_the_child(tmp_path):
    program = tmp_path / "launcher.py"
    program.write_text(WATCHDOG_ONLY)
    assert_child_dies_with(subprocess.Popen([sys.executable, str(program)], stdout=subprocess.PIPE, text=True))


def assert_child_dies_with(launcher: subprocess.Popen) -> None:
    """``launcher`` prints its child's pid; SIGKILL it, then the child must be gone within 5 s."""
    try:
        child = int(launcher.stdout.readline())
        assert alive(child)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the engine process outlived its launcher"
    finally:
        launcher.kill()
