"""The server is safe to expose: local images only under the allowed directory (symlinks followed), image URLs
fetched with limits and never from private addresses unless allowed, an API key on /v1, bodies and prompts
bounded before they cost anything, /health answering throughout, and every field either honoured or
refused."""

import dataclasses
import gzip
import http.server
import io
import ipaddress
import json
import os
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from PIL import Image

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from data import CAPTION_PROMPT  # noqa: E402
from serving.async_engine import AsyncEngine  # noqa: E402
from serving.config import ServingConfig  # noqa: E402
from serving.engine import Engine  # noqa: E402
from serving.media import MediaPolicy, _public, open_image  # noqa: E402
from serving.protocol import RequestLimits  # noqa: E402
from serving.requests import RequestError, RequestParams  # noqa: E402
from serving.server import create_app  # noqa: E402
from tests.models.helpers import base_tokenizer, chat_vlm  # noqa: E402
from tests.serving.test_server import Server, _alone, _data_url, _idle, _png  # noqa: E402
from typed_config import ConfigError  # noqa: E402

KEY = "sesame"


def _ask(server, content, key: str | None = KEY, **fields) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def _image_part(url: str) -> list[dict]:
    return [{"type": "text", "text": "what colour?"}, {"type": "image_url", "image_url": {"url": url}}]


class ImageHost:
    """A local HTTP server: /image.png, /big.png (2 MB), /hop/N (redirects N more times, then to the image),
    /gzip.png (64 MB of zeros, gzip-encoded: a decompression bomb), /slow.png (its headers one byte every 0.2
    s); it counts the requests it gets."""

    def __init__(self) -> None:
        host = self
        self.requests, self.png = 0, _png("red")
        self.bomb = gzip.compress(bytes(64 * 2**20), compresslevel=1)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- the http.server API
                host.requests += 1
                if self.path.startswith("/hop/"):
                    left = int(self.path.rsplit("/", 1)[1])
                    self.send_response(302)
                    self.send_header("Location", f"/hop/{left - 1}" if left else "/image.png")
                    self.end_headers()
                    return
                if self.path == "/slow.png":
                    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n":
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.2)
                    return
                body = {"/image.png": host.png, "/gzip.png": host.bomb}.get(self.path) or os.urandom(
                    2 * 2**20
                )
                self.send_response(200)
                if self.path == "/gzip.png":
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "sky.png").write_bytes(_png("skyblue"))
    (root / "secret.png").write_bytes(_png("black"))
    os.mkfifo(root / "pipe")  # reading it would block: a request must never get that far
    (root / "allowed" / "escape.png").symlink_to(root / "pipe")
    (root / "allowed" / "zero").symlink_to("/dev/zero")
    os.mkfifo(root / "allowed" / "inner-pipe")
    return root


@pytest.fixture(scope="module")
def served(media_dir):
    tokenizer = base_tokenizer()
    model = chat_vlm(tokenizer)
    engine = Engine(model, tokenizer, ServingConfig(num_blocks=400, block_size=8, max_num_seqs=16,
                                                    max_batch_tokens=256))
    async_engine = AsyncEngine(engine, max_in_flight=64)
    limits = RequestLimits(max_body_bytes=2 * 2**20, max_prompt_chars=50_000)
    app = create_app(async_engine, tokenizer, "tiny", limits=limits,
                     media=MediaPolicy(allowed_local_path=media_dir / "allowed", timeout=5), api_key=KEY)
    server = Server(app)
    yield server, model, tokenizer, engine
    server.stop()
    async_engine.shutdown()


def test_the_api_key_guards_every_v1_route_and_nothing_else(served):
    server, *_ = served
    for key in (None, "wrong"):
        response = _ask(server, "hi", key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        headers = {"authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert _ask(server, "hi").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_local_images_are_read_only_under_the_allowed_directory(served, media_dir):
    server, model, tokenizer, engine = served
    inside = _ask(server, _image_part(str(media_dir / "allowed" / "sky.png")), temperature=0)
    assert inside.status_code == 200
    expected = _alone(model, tokenizer, "what colour?", [_png("skyblue")], 4, greedy=True)[0]
    assert inside.json()["choices"][0]["message"]["content"] == expected
    # the same for a file outside and a missing one
    nowhere = "no such file under the allowed media directory"
    refusals = {
        str(media_dir / "secret.png"): nowhere,
        f"file://{media_dir / 'secret.png'}": nowhere,
        str(media_dir / "allowed" / ".." / "secret.png"): nowhere,
        str(media_dir / "allowed" / "escape.png"): nowhere,  # a symlink to a FIFO outside
        str(media_dir / "allowed" / "zero"): nowhere,  # a symlink to /dev/zero
        str(media_dir / "allowed" / "inner-pipe"): "not a regular file",  # a FIFO inside: never opened
        "file:///etc/passwd": nowhere,
        "/etc/no-such-file": nowhere,
        str(media_dir / "allowed" / "missing.png"): nowhere,
        f"file://otherhost{media_dir / 'allowed' / 'sky.png'}": "names no other host",
        str(media_dir / "allowed" / "a\x00b"): "invalid URL",
        "ftp://example.com/a.png": "unsupported URL scheme",
    }
    for url, message in refusals.items():
        start = time.monotonic()
        response = _ask(server, _image_part(url))
        assert response.status_code == 400 and message in response.json()["error"]["message"], (
            url,
            response.text,
        )
        assert time.monotonic() - start < 5, url  # the FIFO was never opened for reading
    _idle(engine)


def test_dev_zero_is_refused_unread_even_where_its_directory_is_allowed():
    tracemalloc.start()
    start = time.monotonic()
    with pytest.raises(RequestError, match="not a regular file"):
        open_image("/dev/zero", 0, MediaPolicy(allowed_local_path=Path("/dev")))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - start < 1 and peak < 2**20


@pytest.mark.parametrize("host", [
    "localhost", "127.0.0.1", "2130706433", "0x7f.1", "10.1.2.3", "192.168.0.7", "169.254.169.254", "0.0.0.0",
    "[::1]", "[::ffff:127.0.0.1]", "[::127.0.0.1]", "[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::]", "[fec0::1]",
    "[fe80::1]", "[2001:0:4136:e378:8000:63bf:3fff:fdd2]",  # Teredo, with 192.0.2.45 inside
])
def test_image_urls_on_private_addresses_are_refused_before_connecting(host):
    with pytest.raises(RequestError, match="loopback, private or link-local"):
        open_image(f"http://{host}:9/a.png", 0, MediaPolicy())


def test_a_refusal_does_not_say_what_a_host_resolves_to():
    with pytest.raises(RequestError) as refusal:
        open_image("http://localhost:9/a.png", 0, MediaPolicy())
    assert "127.0.0.1" not in str(refusal.value) and "::1" not in str(refusal.value), refusal.value


def test_public_addresses_are_public():
    for address in ("8.8.8.8", "2606:4700::1111", "2a00:1450:4007:80e::200e"):
        assert _public(ipaddress.ip_address(address)), address


@pytest.mark.parametrize("url",
                         ["http://[::1", "http://a..b/x", "http://xn--/a", "http://" + "a" * 70 + ".com/x"])
def test_malformed_urls_are_a_400_not_a_500(served, url):
    server, *_ = served
    response = _ask(server, _image_part(url))
    assert response.status_code == 400, response.text


def test_image_urls_are_fetched_with_limits_only_where_allowed(served):
    server, model, tokenizer, engine = served
    host = ImageHost()
    response = _ask(server, _image_part(f"{host.url}/image.png"))
    assert (
        response.status_code == 400
        and "loopback, private or link-local" in response.json()["error"]["message"]
    )
    assert host.requests == 0  # refused before connecting
    allowed = MediaPolicy(allow_private_urls=True, max_bytes=2**20, timeout=5, max_redirects=3)
    fetched = open_image(f"{host.url}/hop/2", 0, allowed)
    assert fetched.tobytes() == Image.open(io.BytesIO(host.png)).convert("RGB").tobytes()
    with pytest.raises(RequestError, match="more than 3 redirects"):
        open_image(f"{host.url}/hop/5", 0, allowed)
    with pytest.raises(RequestError, match="larger than 1048576 bytes"):
        open_image(f"{host.url}/big.png", 0, allowed)
    with pytest.raises(RequestError, match="gzip-encoded"):  # asked for none; never inflated
        open_image(f"{host.url}/gzip.png", 0, allowed)
    start = time.monotonic()
    with pytest.raises(RequestError, match="took longer than 1 s"):  # one header byte every 0.2 s: cut at 1 s
        open_image(f"{host.url}/slow.png", 0, dataclasses.replace(allowed, timeout=1.0))
    assert time.monotonic() - start < 2
    host.server.shutdown()


def test_oversized_bodies_and_prompts_are_refused_while_health_keeps_answering(served, media_dir):
    """A body over the limit (declared, and streamed without a length), a prompt over the character limit and
    /dev/zero as an image: each refused quickly, while /health is polled throughout and never takes 100 ms."""
    server, *_ = served
    latencies, stop = [], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url) as client:
            while not stop.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
        body = json.dumps({"messages": [{"role": "user", "content": "x" * 3 * 2**20}]}).encode()
        checks = [
            (lambda: httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=headers), 413),
            (lambda: httpx.post(f"{server.url}/v1/chat/completions",
                                content=iter([body[i : i + 65536] for i in
                                             range(0, len(body), 65536)]),
                                headers=headers), 413),
            (lambda: _ask(server, "sky " * 2**18), 400),  # 1 MiB of prompt, under the body limit
            # 1.2 MB of objects: refused before parsing
            (lambda: _ask(server, "hi", junk=[{}] * 300_000), 400),
            (lambda: _ask(server, _image_part("/dev/zero")), 400),
        ]
        for send, status in checks:
            start = time.monotonic()
            response = send()
            assert response.status_code == status, response.text
            assert "error" in response.json() and time.monotonic() - start < 5
    finally:
        stop.set()
        poller.join()
    assert len(latencies) > 5 and max(latencies) < 0.1, max(latencies)


def test_fields_are_honoured_or_refused(served):
    server, model, tokenizer, engine = served
    for fields, message in [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                            ({"logit_bias": {"5": 10}}, "logit_bias"),
                            ({"response_format": {"type": "xml"}}, "response_format"),
                            ({"top_logprobs": 2}, "needs logprobs"),
                            ({"frequency_penalty": 0.5}, "frequency_penalty"),
                            ({"foo": 1}, "foo: not a field"), ({"model": "gpt-4o"}, "does not exist")]:
        response = _ask(server, "hi", **fields)
        assert 400 <= response.status_code < 500 and message in response.json()["error"]["message"], (
            response.text
        )
    assert _ask(server, "hi", model="gpt-4o").status_code == 404
    neutral = {"logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0, "tools": [],
               "user": "someone", "response_format": {"type": "text"}, "model": "tiny"}
    assert _ask(server, "hi", **neutral).status_code == 200
    ignored_eos = _ask(server, "hi", ignore_eos=True, max_tokens=30, temperature=0).json()
    assert ignored_eos["usage"]["completion_tokens"] == 30
    missing = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi"},
                         headers={"authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    _idle(engine)


BOUNDED = [  # fields out of range, each a 400 naming the field, in a short message
    ({"seed": 2**64}, "seed: Input should be less than or equal to 9223372036854775807"),
    ({"seed": -(2**63) - 1}, "seed: Input should be greater than or equal to -9223372036854775808"),
    ({"top_k": 10**30}, "top_k: Input should be less than or equal to 2147483647"),
    ({"stop": ["s"] * 17}, "stop: 17 stop strings; at most 16 allowed"),
    ({"stop": "s" * 257}, "stop: a stop string of 257 characters; at most 256 allowed"),
    ({"stop": ["s", ""]}, "stop: an empty stop string"),
    ({"guided_choice": ["yes"] * 257}, "guided_choice: List should have at most 256 items"),
    ({"guided_choice": ["y" * 257]}, "guided_choice.0: String should have at most 256 characters"),
    ({"messages": [{"role": "user", "content": "hi"}] * 1025},
     "messages: List should have at most 1024 items"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 65}]},
     "messages.0.content: List should have at most 64 items"),
    ({"model": "m" * 100_000}, "model: String should have at most 256 characters"),
    ({"logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias: {'0': 1, '1': 1"),
    ({"x" * 100_000: 1}, "xxx...: not a field of this API"),
    ({"n": "x" * 100_000}, "n: Input should be a valid integer"),
]


@pytest.mark.parametrize("fields, message", BOUNDED, ids=[str(list(f))[:30] for f, _ in BOUNDED])
def test_every_field_is_bounded(served, fields, message):
    """Out of range is a 400 in OpenAI's shape (a seed beyond 64 bits was a 500, a top_k beyond 64 bits failed
    every request in flight), and a refusal quotes at most a little of what was sent."""
    server, *_ = served
    response = _ask(server, "hi", **fields)
    error = response.json()["error"]
    assert response.status_code == 400 and message in error["message"], response.text[:500]
    assert len(error["message"]) < 200 and set(error) == {"message", "type", "param", "code"}, error


def test_the_edges_of_each_bound_are_served(served):
    server, *_ = served
    for fields in ({"seed": 2**63 - 1}, {"seed": -(2**63)}, {"top_k": 2**31 - 1},
                   {"stop": [f"{i:x}" * 256 for i in range(16)]}, {"guided_choice": ["y" * 256, "no"]}):
        response = _ask(server, "hi", **fields)
        assert response.status_code == 200, (fields, response.text[:300])
    completion = httpx.post(f"{server.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                            json={"prompt": "hi", "seed": 2**70, "max_tokens": 2})
    assert completion.status_code == 400 and completion.json()["error"]["param"] == "seed"


def test_the_engine_refuses_a_seed_or_top_k_out_of_range_before_a_step_seats_it():
    """Through the Python API too: a top_k beyond 64 bits failed the step that seated it, and with it every
    request in flight."""
    for settings in ({"seed": 2**64}, {"seed": -(2**63) - 1}, {"top_k": 2**31}):
        with pytest.raises(ConfigError, match=next(iter(settings))):
            RequestParams(**settings)


def test_an_engine_failure_tells_the_client_no_more_than_its_type():
    """A step that raises fails its requests with the error's type; its message, which may name paths of the
    server's machine, goes to the server's log only."""
    tokenizer = base_tokenizer()
    engine = Engine(chat_vlm(tokenizer), tokenizer, ServingConfig(num_blocks=64, block_size=8))
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("failed at /home/server/secret.py:12"))
    lines = []
    async_engine = AsyncEngine(engine, log=lines.append)
    try:
        app = create_app(async_engine, tokenizer, "tiny")
        from fastapi.testclient import TestClient

        response = TestClient(app).post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "hi"}], "max_tokens": 2})
    finally:
        async_engine.shutdown()
    assert response.status_code == 500 and "/home" not in response.text, response.text
    assert "RuntimeError" in response.json()["error"]["message"]
    assert any("/home/server/secret.py" in line for line in lines), lines


def test_without_max_tokens_the_answer_may_fill_the_context(served):
    server, model, *_ = served
    reply = _ask(server, "hi", max_tokens=None, ignore_eos=True).json()
    usage = reply["usage"]
    assert (
        usage["prompt_tokens"] + usage["completion_tokens"] == model.config.language.max_position_embeddings
    )
    assert reply["choices"][0]["finish_reason"] == "length"


def test_an_image_without_text_asks_for_a_caption(served):
    server, model, tokenizer, engine = served
    image = _png("orange")
    reply = _ask(server, [{"type": "image_url", "image_url": {"url": _data_url(image)}}], temperature=0)
    assert reply.status_code == 200
    expected = _alone(model, tokenizer, CAPTION_PROMPT, [image], 4, greedy=True)[0]
    assert reply.json()["choices"][0]["message"]["content"] == expected
