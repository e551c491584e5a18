"""``redline train`` turns SIGTERM into an exit through ``finally`` blocks (where launched servers are stopped), and
a native abort into a Python stack of every thread on stderr; a torchrun rank ends without interpreter finalization."""

import os
import signal
import subprocess
import sys

import pytest

PROGRAM = """
import os, signal, time
from redline.cli import exit_on_sigterm
exit_on_sigterm()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
finally:
    print("cleanup ran", flush=True)
"""


def test_sigterm_runs_finally_blocks_and_exits_143():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert done.stdout.strip() == "cleanup ran"


ABORTING_REWARD = """
import os


async def reward_that_aborts(sample):
    os.abort()  # a native crash, as a C++ std::terminate in an extension would be
"""


def test_a_native_abort_prints_where_every_thread_was(tmp_path):
    from pathlib import Path

    (tmp_path / "aborting_reward.py").write_text(ABORTING_REWARD)
    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"
    done = subprocess.run(
        [sys.executable, "-m", "redline.cli", "train", str(quickstart), "--num-rollout", "1", "--sft-steps", "0",
         "--custom-rm-path", "aborting_reward:reward_that_aborts", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == -signal.SIGABRT, done.stderr[-2000:]
    assert "Fatal Python error: Aborted" in done.stderr
    assert 'aborting_reward.py", line 6 in reward_that_aborts' in done.stderr  # the Python stack of the abort


ENDING = """
import atexit
from redline.cli import end_process
atexit.register(lambda: print("finalized", flush=True))
print("the run's output", end="")  # left in the buffer: end_process must flush it
end_process(3)
"""


@pytest.mark.parametrize("torchrun, finalized", [(False, True), (True, False)])
def test_a_torchrun_rank_ends_without_finalization_and_loses_no_output(torchrun, finalized):
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    done = subprocess.run([sys.executable, "-c", ENDING], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("the run's output")
    assert ("finalized" in done.stdout) is finalized  # atexit handlers run only where the interpreter finalizes
