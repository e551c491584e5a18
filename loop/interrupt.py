"""Ctrl-C during training: finish the step in flight, then stop at that safe point (checkpoint, report, plots).

``GracefulStop`` turns the first SIGINT into a request the loop reads between steps; a second SIGINT raises
``KeyboardInterrupt`` at once, as without it. It only acts in the main thread (where Python delivers signals).
"""

import signal
import threading

EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a run stopped by Ctrl-C


class GracefulStop:
    """``requested``: a Ctrl-C came; ``stopped_at``: the step after which the loop stopped for it (set by the
    loop), None while it runs or when it finished."""

    def __init__(self, announce=print):
        self.requested = False
        self.stopped_at: int | None = None
        self._announce = announce
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._announce("Ctrl-C: stopping after the current step (press it again to stop at once)")

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
