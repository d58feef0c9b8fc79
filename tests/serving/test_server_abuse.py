"""The server on loopback under the abuse that stalled it (issue 56), each finding a regression test: a flood
of stop strings, bodies and request heads sent in part and then silence, a client gone while sending its body;
and a load test of 200 streams, some cancelled, while abusive clients connect. Latencies are asserted with
wide margins (a second, where alone they take milliseconds), to hold on a loaded 2-core CPU."""

import asyncio
import functools
import gc
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serving.protocol import RequestLimits  # noqa: E402
from tests.serving.test_server import _alone, _idle, _message, _png, serving  # noqa: E402

DEADLINE = 2.0  # the test server's deadlines for a request's head and for its body (seconds)
FAST = 1.0  # what a normal request or /health may take while the server is abused (seconds)
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n")
HALF_BODY = HEAD + b'{"messag'  # 8 of its 1,000 bytes


@pytest.fixture(scope="module")
def served():
    with serving(RequestLimits(body_timeout=DEADLINE), header_timeout=DEADLINE) as setup:
        yield setup


@functools.cache
def _stop_flood(count: int) -> bytes:
    """A request of `count` stop strings (1,000,000: 13 MB, under the body limit)."""
    return json.dumps({"messages": _message("hi"), "max_tokens": 4, "stop": ["stop here"] * count}).encode()


def _post(server, content: bytes, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=timeout)


def _latencies(server) -> list[float]:
    """How long /health and a normal request take."""
    latencies = []
    for send in (lambda: httpx.get(f"{server.url}/health", timeout=30),
                 lambda: _post(server, json.dumps({"messages": _message("hi"), "max_tokens": 4}).encode())):
        start = time.monotonic()
        assert send().status_code == 200
        latencies.append(time.monotonic() - start)
    return latencies


def _connect(server, sent: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE + 10)
    connection.sendall(sent)
    return connection


def _answer(connection: socket.socket) -> bytes:
    """All the server sends until it closes the connection (socket.timeout if it never does)."""
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    return answer


def test_full_collections_while_serving_skip_what_was_alive_at_start_up(served):
    """A full garbage collection holds the GIL while it walks the heap, stalling every stream and /health
    (1.3-4.4 s over this test suite's heap, which failed the latency bounds here): the server freezes what was
    alive when it started (the model among it), so that a collection walks only what requests allocated."""
    server, _, model, *_ = served
    assert _latencies(server)
    walked = gc.get_objects()
    assert not any(thing is model or thing is server for thing in walked)
    assert len(walked) < gc.get_freeze_count()


def test_a_million_stop_strings_are_refused_while_requests_and_health_stay_fast(served):
    """1,000,000 stop strings (refused before parsing: too many JSON values) and 100,000 (refused after: over
    the stop-string limit), while /health and a normal request are timed throughout; 16 stop strings of 256
    characters, the limits, are served."""
    server, *_ = served
    replies, floods = {}, {count: _stop_flood(count) for count in (1_000_000, 100_000)}
    senders = [threading.Thread(target=lambda c=count: replies.update({c: _post(server, floods[c])}))
               for count in floods]
    for sender in senders:
        sender.start()
    latencies = []
    while any(sender.is_alive() for sender in senders) or not latencies:
        latencies += _latencies(server)
    for sender in senders:
        sender.join()
    assert replies[1_000_000].status_code == 400, replies[1_000_000].text
    assert "JSON objects, arrays and items" in replies[1_000_000].json()["error"]["message"]
    assert replies[100_000].status_code == 400
    assert replies[100_000].json()["error"]["message"] == "stop: 100000 stop strings; at most 16 allowed"
    assert max(latencies) < FAST, latencies
    most = [f"{i:x}" * 256 for i in range(16)]
    assert _post(server, json.dumps({"messages": _message("hi"), "max_tokens": 4, "stop": most}).encode()
                 ).status_code == 200


def test_silent_half_sent_bodies_hold_no_slot_and_are_closed_at_their_deadline(served):
    """64 connections send their headers and 8 bytes of a 1,000-byte body, then nothing (twice the 32
    preparation slots): a normal request and /health stay fast, and each gets a 408 and its connection
    closed once its body's deadline passes."""
    server, *_ = served
    connections = [_connect(server, HALF_BODY) for _ in range(64)]
    try:
        time.sleep(0.2)  # the server reads them
        assert max(_latencies(server)) < FAST
        for connection in connections:
            answer = _answer(connection)
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in answer, answer
    finally:
        for connection in connections:
            connection.close()


def test_connections_that_never_finish_a_request_head_are_closed_at_their_deadline(served):
    """Connections that send nothing, part of a head, or a whole request and then part of the next one's head:
    a normal request stays fast, and each connection is closed once the head's deadline passes (uvicorn
    alone keeps them all)."""
    server, *_ = served
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    silent = [_connect(server, sent) for sent in (b"", HEAD[:40]) for _ in range(32)]
    again = _connect(server, health)
    try:
        first = b""
        while not first.endswith(b"}}"):  # the whole first answer: {"status":"ok","serving":{...}}
            first += again.recv(65536)
        assert b'{"status":"ok",' in first
        again.sendall(health[:20])
        assert max(_latencies(server)) < FAST
        for connection in silent:
            assert _answer(connection) == b""
        assert _answer(again) == b""
    finally:
        for connection in [*silent, again]:
            connection.close()


def test_a_client_gone_while_sending_its_body_is_one_line_in_the_log(served):
    server, *_ = served
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        connection = _connect(server, HALF_BODY)
        time.sleep(0.3)  # the server reads the body
        connection.close()
        deadline = time.monotonic() + 10
        while not records and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # any more lines it writes
    finally:
        log.removeHandler(handler)
    assert len(records) == 1 and records[0].exc_info is None, [r.getMessage() for r in records]
    assert "went away while sending POST /v1/chat/completions" in records[0].getMessage()


def _live_objects() -> tuple[int, int]:
    """How many objects the collector tracks (containers: a leaked request's state is hundreds), and how many
    of them are tensors, after a collection."""
    gc.collect()
    objects = gc.get_objects()
    return len(objects), sum(issubclass(type(obj), torch.Tensor) for obj in objects)


OVERSIZED = [  # well-formed JSON, each a 400
    {"messages": _message("hi"), "logit_bias": {str(i): 1 for i in range(10_000)}},
    {"messages": _message("hi"), "model": "m" * 10_000},
    {"messages": _message("hi") * 2000},
    {"messages": _message("hi"), "seed": 2**64},
    {"messages": _message("hi"), "stop": ["s" * 100_000]},
    {"messages": _message("hi"), "guided_choice": ["yes"] * 10_000},
]


async def _abuse(server) -> list[str]:
    """Abusive clients, all at once: silent half-sent bodies (answered 408), silent half-sent heads (closed),
    clients gone mid-body, stop-string floods and oversized fields (400); what each got, where it differs from
    that."""
    port, wrong = server.port, []

    async def silent(sent: bytes, expected: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(sent)
        answer = await asyncio.wait_for(reader.read(), DEADLINE + 30)
        if not answer.startswith(expected) or (not expected and answer):
            wrong.append(f"{sent[:30]!r}: {answer[:60]!r}")
        writer.close()

    async def gone() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HALF_BODY)
        await asyncio.sleep(0.2)
        writer.close()

    async def refused(http: httpx.AsyncClient, content: bytes) -> None:
        response = await http.post("/v1/chat/completions", content=content,
                                   headers={"content-type": "application/json"})
        if response.status_code != 400:
            wrong.append(f"{content[:60]!r}: {response.status_code}")

    bodies = [_stop_flood(1_000_000), _stop_flood(100_000)] * 2 + [json.dumps(b).encode() for b in OVERSIZED]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        await asyncio.gather(*(silent(HALF_BODY, b"HTTP/1.1 408") for _ in range(16)),
                             *(silent(HEAD[:40], b"") for _ in range(16)), *(gone() for _ in range(8)),
                             *(refused(http, body) for body in bodies))
    return wrong


def test_load_200_streams_some_cancelled_while_abusive_clients_connect(served):
    """200 concurrent streaming requests, one in five cancelled after its first words, while abusive clients
    connect (_abuse): every other stream gets exactly its answer, each abuser its refusal, no block leaks, and
    a second round leaves nothing alive: under 500 more objects tracked by the collector (a round without a
    leak leaves none more; keeping each request's state leaves 2,100 more, 134 of them tensors) and under 20
    more tensors. (Resident memory misleads here: the allocator's arenas, shaped by earlier tests, grew by
    56-80 MiB in the full suite without a leak; tracemalloc slowed the server past the body deadline on a
    loaded CPU.)"""
    server, client, model, tokenizer, engine = served
    images = [_png(color) for color in ("red", "green", "blue", "white")]
    prompts = [("what colour is the sky?", images[i % 4]) for i in range(4)] + [("the sky", None)] * 2
    expected = [_alone(model, tokenizer, text, [image] if image else [], 10, greedy=True)[0]
                for text, image in prompts]

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        text, image = prompts[i % len(prompts)]
        body = {"messages": _message(text, *([image] if image else [])), "max_tokens": 10, "temperature": 0,
                "stream": True}
        answer = ""
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"]
                answer += (delta[0]["delta"].get("content") or "") if delta else ""
                if i % 5 == 4 and answer:
                    return i, None  # cancelled mid-stream: leaving the block closes the connection
        return i, answer

    async def round_of(count: int) -> tuple[list[tuple[int, str | None]], list[str]]:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            streams = asyncio.gather(*(one(http, i) for i in range(count)))
            return await asyncio.wait_for(asyncio.gather(streams, _abuse(server)), timeout=300)

    for round_number in range(2):
        if round_number == 1:  # what the second round leaves alive is a leak
            before = _live_objects()
        results, wrong = asyncio.run(round_of(200))
        _idle(engine, timeout=60)
        assert not wrong, wrong
        for i, answer in results:
            if answer is not None:
                assert answer == expected[i % len(prompts)], i
        assert sum(answer is None for _, answer in results) > 0
    objects, tensors = (after - was for after, was in zip(_live_objects(), before, strict=True))
    assert objects < 500 and tensors < 20, (objects, tensors)
