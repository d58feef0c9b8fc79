"""The server's error replies, in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): refusals
(4xx), unknown routes, a client gone before its request was read (one log line), and anything unforeseen (a
500 naming only the error's type). A message is one short line whatever the request held: the request's own
values are quoted cut short."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("uvicorn.error")  # the server's log, as uvicorn writes it
KINDS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "server_error"}


class Refused(Exception):
    """A request answered with a 4xx (or a 503) before any work: the status, the message, the error code, the
    field at fault, and whether to close the connection (a body left unread)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 close: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.close = status, code, param, close


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


def shown(text: str, limit: int = 60) -> str:
    """Text from a request as a message quotes it: cut short."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def invalid(exc: ValidationError) -> Refused:
    """A request the protocol's models refuse: a 400 naming the field, as OpenAI's API answers. Of a union's
    errors, one that is not merely the wrong type for a member is the telling one (a list of content parts
    with a bad part is not 'not a string'); the members' names leave the field's path."""
    problems = exc.errors()
    if not problems:
        return Refused(400, "invalid request")
    problem = min(problems, key=lambda p: p["type"].endswith("_type"))
    if problem["type"] == "json_invalid":
        return Refused(400, "the request body is not valid JSON")
    where = ".".join(shown(str(part), 40) for part in problem["loc"] if not _union_member(part)) or None
    return Refused(400, f"{where + ': ' if where else ''}{problem['msg']}", param=where)


def _union_member(part: str | int) -> bool:
    """A path element that names a union's member type (`str`, `list[ContentPart]`), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def add_error_handlers(app: FastAPI) -> None:
    for kind, handler in ((HTTPException, http_error), (Refused, refused), (ClientDisconnect, client_gone),
                          (Exception, internal_error)):
        app.add_exception_handler(kind, handler)


async def refused(_, exc: Refused) -> JSONResponse:
    return error(exc.status, str(exc), KINDS.get(exc.status, "invalid_request_error"), exc.code, exc.param,
                 {"connection": "close"} if exc.close else None)


async def client_gone(http: Request, _: ClientDisconnect) -> Response:
    """A client that went away before its request was read: one line in the log, no traceback (and an answer
    nobody reads)."""
    client = f"{http.client.host}:{http.client.port}" if http.client else "a client"
    log.warning("%s went away while sending %s %s", client, http.method, http.url.path)
    return Response(status_code=400)


async def internal_error(_, exc: Exception) -> JSONResponse:
    """Anything unforeseen: a 500 in OpenAI's error shape, naming the error's type, with no traceback for the
    client (the server's log has it)."""
    log.error("%s: %s", type(exc).__name__, exc)
    return error(500, f"internal server error ({type(exc).__name__})", "server_error")


async def http_error(http: Request, exc: HTTPException) -> JSONResponse:
    """Unknown routes and methods in OpenAI's error shape (a client's own error handling reads it)."""
    return error(exc.status_code, f"{exc.detail}: {http.method} {shown(http.url.path, 200)}",
                 "not_found_error" if exc.status_code == 404 else "invalid_request_error")
