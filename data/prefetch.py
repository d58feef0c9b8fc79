"""A producer thread that keeps a bounded queue of batches ahead of the training step, so that a step never
waits for images to be decoded, records encoded and packed where the DataLoader has no worker processes (the
decoding releases the GIL while the GPU runs the step); at most `depth` batches are held.

    with prefetched(batches, depth=2) as ahead:
        batch = next(ahead)   # the same batches, in the same order
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

_DONE = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """`batches` read by a daemon thread into a queue of `depth`; an error the iterator raises is raised by
    `next` in its place; `close` stops the thread."""

    def __init__(self, batches: Iterator[Any], depth: int) -> None:
        self._batches, self._queue = batches, queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batch-producer", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for batch in self._batches:
                if not self._put(batch):
                    return
            self._put(_DONE)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(_Failed(error))

    def _put(self, item: Any) -> bool:
        """Whether `item` went into the queue before `close`."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)  # every later call ends too
            raise StopIteration
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def prefetched(batches: Iterator[Any], depth: int) -> Iterator[Prefetcher]:
    """`batches` through a `Prefetcher` of `depth`, stopped with the block."""
    ahead = Prefetcher(batches, depth)
    try:
        yield ahead
    finally:
        ahead.close()
