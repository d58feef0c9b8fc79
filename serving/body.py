"""A request's body, read with limits before any other work: its size, a deadline for the whole of it, and a
budget of the bytes all bodies being read or waiting to be prepared may hold at once. Bodies are read outside
the preparation slots, so a client that sends part of a body and goes silent holds a few bytes until its
deadline, never a slot; the budget bounds what many large bodies at once may hold, as the slots did."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request

from serving.errors import Refused
from serving.protocol import RequestLimits


@dataclasses.dataclass
class BodyBudget:
    """Bytes of request bodies the server may still hold (used from the event loop alone: no lock)."""

    left: int


@contextlib.asynccontextmanager
async def read_body(http: Request, limits: RequestLimits, budget: BodyBudget) -> AsyncIterator[bytearray]:
    """The request's body, its bytes counted against `budget` until the block ends. Refused, and the
    connection closed with the rest of the body unread, as soon as it is known to exceed
    `limits.max_body_bytes` (413: by its Content-Length before anything is read, or as it streams in), when it
    has not all arrived within `limits.body_timeout` seconds (408), or when the budget has no room for it
    (503). A client that goes away meanwhile raises starlette's ClientDisconnect."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise Refused(413, f"the request body ({declared} bytes) exceeds the limit of "
                           f"{limits.max_body_bytes} bytes", close=True)
    if declared.isdigit() and int(declared) > budget.left:
        raise _busy()
    body = bytearray()
    try:
        try:
            await asyncio.wait_for(_read(http, limits.max_body_bytes, budget, body), limits.body_timeout)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
            raise Refused(408, f"the request body did not arrive within {limits.body_timeout:g} s",
                          "request_timeout", close=True) from None
        yield body
    finally:
        budget.left += len(body)


async def _read(http: Request, limit: int, budget: BodyBudget, body: bytearray) -> None:
    """Append the body's chunks to `body` as they come, each counted against `budget`."""
    async for chunk in http.stream():
        if len(body) + len(chunk) > limit:
            raise Refused(413, f"the request body exceeds the limit of {limit} bytes", close=True)
        if len(chunk) > budget.left:
            raise _busy()
        budget.left -= len(chunk)
        body += chunk


def _busy() -> Refused:
    return Refused(503, "the server holds too many request bodies at once; try again later", "server_busy",
                   close=True)
