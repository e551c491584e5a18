"""``redline train`` turns SIGTERM into an exit through ``finally`` blocks (where launched servers are stopped)."""

import subprocess
import sys

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
