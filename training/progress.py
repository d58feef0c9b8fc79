"""Progress lines by the clock: a run says what it is doing when it starts each long part and at least every
REPORT_S seconds while it lasts, however fast or slow its steps (a line per step count alone left the start-up
and the ViT's pre-training silent for up to ~85 s)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

REPORT_S = 10.0  # seconds between progress lines
POLL_S = 0.5  # how often a Phase's thread looks at the clock


def now() -> float:
    """The clock progress is timed by (monotonic seconds)."""
    return time.monotonic()


class Every:
    """`due()` at most once per `seconds`, counted from its creation and from each time it was due."""

    def __init__(self, seconds: float = REPORT_S) -> None:
        self.seconds, self.last = seconds, now()

    def due(self) -> bool:
        current = now()
        if current - self.last < self.seconds:
            return False
        self.last = current
        return True


class Phase:
    """A part of the run that says it started (`announce`) and, while it lasts, that it still runs, every
    REPORT_S seconds from a thread of its own: the work itself (reading a dataset, a compiled first step) need
    not report. Ends with its `with` block, or earlier with `end()`."""

    def __init__(self, what: str, say: Callable[..., None], announce: bool = True) -> None:
        self.what, self.say, self.announce = what, say, announce
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Phase:
        if self.announce:
            self._say(f"{self.what} ...")
        self._started, self._every = now(), Every()
        self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(POLL_S):
            if self._every.due():
                self._say(f"{self.what} ... ({now() - self._started:.0f} s)")

    def _say(self, line: str) -> None:
        self.say(line)
        sys.stdout.flush()  # `say` may be print or tqdm.write: neither flushes a pipe

    def end(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __exit__(self, *exc) -> None:
        self.end()
