"""The engine on its own thread, for an asyncio server: requests go in through a thread-safe inbox, each
step's tokens come back to the request's asyncio queue. The engine itself is used from that one thread
only."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import Callable

from serving.engine import Engine
from serving.requests import Output, Request
from serving.sequence import RequestState


class QueueFull(Exception):
    """More requests are in flight than the server admits (answered with 429)."""


class EngineFailure:
    """Delivered to a request's queue instead of an Output when a step raised."""

    def __init__(self, message: str) -> None:
        self.message = message


class AsyncEngine:
    def __init__(self, engine: Engine, max_in_flight: int = 256, log: Callable[[str], None] | None = None,
                 log_every: float = 10.0) -> None:
        self.engine, self.max_in_flight = engine, max_in_flight
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.lock = threading.Lock()  # guards `streams` (its size is the in-flight count)
        self.log = log
        self.log_every = log_every
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def prepare(self, request: Request) -> RequestState:
        """Check and encode a request (any thread: no engine state changes); raises RequestError."""
        return self.engine.prepare(request)

    @property
    def full(self) -> bool:
        with self.lock:
            return len(self.streams) >= self.max_in_flight

    def submit(self, group: RequestState) -> asyncio.Queue:
        """Queue a prepared request (from the event loop); returns the queue its Outputs arrive on. Raises
        QueueFull."""
        stream: asyncio.Queue = asyncio.Queue()
        with self.lock:
            if len(self.streams) >= self.max_in_flight:
                raise QueueFull(f"{len(self.streams)} requests in flight; try again later")
            self.streams[group.request_id] = (asyncio.get_running_loop(), stream)
        self.inbox.put(("add", group))
        self.wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away) and free its blocks; safe to call for finished ones."""
        with self.lock:
            self.streams.pop(request_id, None)
        self.inbox.put(("abort", request_id))
        self.wake.set()

    def stats(self) -> dict:
        with self.lock:
            in_flight = len(self.streams)
        return {**self.engine.stats(), "in_flight": in_flight}

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        last_log = time.monotonic()
        while not self.stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.wake.wait(timeout=1.0)
                self.wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 -- a failed step fails its requests, never the server
                if self.log:  # an internal fault: its traceback, for whoever runs the server
                    self.log(f"error: a step failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                # the client learns the error's type only: its message may name paths of this machine
                self._fail_all(f"the engine failed on a step ({type(e).__name__}); the server's log has more")
                continue
            for output in outputs:
                self._deliver(output.request_id, output, final=output.finished)
            if self.log and time.monotonic() - last_log > self.log_every:
                last_log = time.monotonic()
                self.log(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in self.stats().items()))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(item)
            else:
                self.engine.abort(item)

    def _add(self, group: RequestState) -> None:
        with self.lock:
            alive = group.request_id in self.streams
        if alive:  # not aborted while it waited in the inbox
            self.engine.enqueue(group)

    def _deliver(self, request_id: str, item: Output | EngineFailure, final: bool) -> None:
        with self.lock:
            target = self.streams.pop(request_id, None) if final else self.streams.get(request_id)
        if target is None:  # the client went away: its abort is in the inbox
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed
            pass

    def _fail_all(self, message: str) -> None:
        """End every request after a failed step: each unfinished one aborted, and every stream still open
        told (an overlapped step may have finished a request whose final output the failure lost)."""
        for request_id in list(self.engine.groups):
            self.engine.abort(request_id)
        with self.lock:
            request_ids = list(self.streams)
        for request_id in request_ids:
            self._deliver(request_id, EngineFailure(message), final=True)
