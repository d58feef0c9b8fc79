"""Stop signals: SIGINT / SIGTERM let the training loop finish its step and write a checkpoint before it
returns."""

from __future__ import annotations

import signal
import threading


class GracefulStop:
    """SIGINT / SIGTERM ask the loop to finish its step, write a checkpoint and return; a second signal stops
    at once, unless `escalate` is off: under torchrun a worker often gets the same signal twice (from the
    scheduler and from torchrun), and stopping one rank at once would leave the others waiting in a
    collective."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, escalate: bool = True) -> None:
        self.escalate = escalate

    def __enter__(self) -> GracefulStop:
        self.requested: str | None = None
        on_main_thread = threading.current_thread() is threading.main_thread()
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS} if on_main_thread else {}
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:
        if self.requested and self.escalate:
            self.restore()
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
