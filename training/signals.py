"""Stop signals. Until a run has something to save, SIGINT / SIGTERM end it at once with one line
(`end_at_once`); from then on (`GracefulStop`) they let the run finish its step, write a checkpoint and
return."""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def end_at_once() -> None:
    """SIGINT / SIGTERM end the process with exit code 130 and one line on stderr (no traceback), wherever it
    is: for train.py's start-up (imports, config, data, model), before there is anything to save. A
    `GracefulStop` takes over for the rest of the run and hands back to this when it ends."""
    for s in SIGNALS:
        signal.signal(s, _end)


def _end(signum: int, frame) -> None:
    print(f"{signal.Signals(signum).name}: stopped before training started; nothing to save", file=sys.stderr,
          flush=True)
    sys.exit(130)


class GracefulStop:
    """SIGINT / SIGTERM ask the run to finish its step, write a checkpoint and return; a second signal stops
    at once, unless `escalate` is off: under torchrun a worker often gets the same signal twice (from the
    scheduler and from torchrun), and stopping one rank at once would leave the others waiting in a
    collective. A process forked while it is in place (a DataLoader worker) gets each signal's default
    action: multiprocessing ends a worker with SIGTERM."""

    def __init__(self, escalate: bool = True) -> None:
        self.escalate = escalate
        self.requested: str | None = None  # the signal's name, once one came
        self.previous: dict = {}

    def __enter__(self) -> GracefulStop:
        self.requested, self._pid = None, os.getpid()
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS} if on_main_thread else {}
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked child inherited the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.requested and self.escalate:
            self.restore()
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
