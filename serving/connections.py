"""uvicorn set up for an open network: every connection is timed, as a well-run HTTP server times them.

uvicorn closes a keep-alive connection left idle after a response (`timeout_keep_alive`), but nothing else: a
connection that never sends a whole request head (a slowloris: a byte of headers now and then, or nothing at
all) is held forever, and its first byte cancels even the keep-alive timer. Here each request's head must
arrive within `header_timeout` seconds of the connection opening or of the previous response, or the
connection is closed; a head is at most h11's 16 KiB. The body is the app's to time (serving/body.py), as it
reads it.
"""

from __future__ import annotations

import asyncio
import functools

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head does not arrive in time."""

    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.head_deadline is not None:  # a request's head arrived
            self.head_deadline.cancel()
            self.head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        self.head_deadline = self.loop.call_later(self.header_timeout, self._head_late)

    def _head_late(self) -> None:
        self.head_deadline = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def server_config(app, host: str, port: int, header_timeout: float = 10.0, keep_alive_timeout: int = 5,
                  log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for the app: h11 with a deadline for each request's head, idle keep-alive
    connections closed after `keep_alive_timeout` seconds."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_keep_alive=keep_alive_timeout,
                          http=functools.partial(TimedH11Protocol, header_timeout=header_timeout))
