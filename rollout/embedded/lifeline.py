"""A spawned child whose life its parent owns: a SIGKILLed launcher leaves no engine process holding memory, and
a Ctrl-C at the terminal (sent to the whole process group) is left to the launcher, which stops the child at its
own safe point.

``die_with_parent()`` is called first thing in the child; it ignores SIGINT from then on. On Linux the kernel
sends the child SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``; strictly, when the parent *thread*
that started it ends, so start such children from a thread that lives as long as they do, as ``redline train``
does from its main thread). Everywhere, a daemon thread also waits on the pipe the parent holds for
``multiprocessing`` (its end closes when the parent dies, however it dies) and exits the child then: the
fallback off Linux, or if the prctl fails.
"""

import ctypes
import ctypes.util
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """In a ``multiprocessing`` child: end this process when its parent process ends; ignore SIGINT."""
    parent = multiprocessing.parent_process()
    if parent is None:
        raise RuntimeError("die_with_parent() is for a multiprocessing child process")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent.pid:  # the parent died before the prctl took effect
        os._exit(1)
    threading.Thread(target=_exit_when_gone, args=(parent.sentinel,), daemon=True,
                     name="parent-watchdog").start()


def _exit_when_gone(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)  # no cleanup to run: the parent that would wait for it is gone
