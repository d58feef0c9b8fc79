"""An OpenAI-compatible HTTP server for a tinyvlm checkpoint (FastAPI + uvicorn: `pip install -e .[serve]`).

    python -m serving.server --checkpoint runs/tiny --host 127.0.0.1 --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What color is the circle?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}])

(the model's name is the checkpoint directory's, here `tiny`, or --model-name; GET /v1/models lists it)

Endpoints: POST /v1/chat/completions (a conversation: system, user and assistant messages, images in any user
message; `n`, `max_tokens` (default: the rest of the context), `temperature`, `top_p`, `top_k`, `seed`,
`stop`, `ignore_eos`, `logprobs` / `top_logprobs`, `response_format` json_object / json_schema,
`guided_choice`, streaming as server-sent events with `stream_options.include_usage`), POST /v1/completions (a
plain text prompt or token ids, the same settings but log-probabilities), GET /v1/models and
/v1/models/{id}, /health (and the engine's settings, as resolved at start-up and printed there: the options
of serving/config.py's ServingConfig, --attention, --kv-cache-mib, --max-num-seqs, --enforce-eager, ...) and
/metrics (Prometheus' text format: running and waiting requests, KV-cache blocks, prefix-cache hits,
preemptions, tokens in and out, time to first token and between tokens, end to end). A client that
disconnects aborts its request; bad requests get a 4xx JSON error in OpenAI's shape, and a full server
answers 429.

Safe to expose: with --api-key (or TINYVLM_API_KEY) every /v1 route wants `Authorization: Bearer KEY` (401
without); images (and a `video_url` clip, as vLLM takes it: its frames sampled as the checkpoint's `video`
settings say, data/video.py) come as data URLs, as http(s) URLs fetched with limits from public addresses
only (--allow-private-image-urls lifts that), or as local files under --allowed-local-media-path only (none by
default). Every field is bounded (serving/protocol.py: a seed to 64 bits, at most --max-stop-strings (16)
stop strings of --max-stop-chars (256) each, 1024 messages, 64 content parts a message, 256 guided choices);
the body's size is checked before it is read, its JSON values before it is parsed and the prompt's length
before it is tokenized. Each connection is timed: a request's head must arrive within --header-timeout (10 s)
of the connection or of the last response, its body within --body-timeout (30 s), an idle keep-alive
connection closes after 5 s. Bodies are read outside the 32 preparation slots (a body sent slowly holds none)
and hold at most --max-buffered-mib (256) in all (then 503); a request is parsed, its images fetched and
decoded and its prompt tokenized off the event loop, and stop strings are matched by one automaton whatever
their number, so /health and the other streams keep answering. A client gone while sending its body is one
line in the log; no message shows a path of the server's machine or what a host resolves to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import os
import secrets
import sys
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from data.detokenizer import IncrementalDetokenizer
from loading import load_for_inference, pick_device
from models.errors import TinyVLMError
from models.quantize import QUANTIZATIONS, describe, weights_summary
from serving.async_engine import AsyncEngine, EngineFailure, QueueFull
from serving.body import BodyBudget, read_body
from serving.config import ServingConfig, add_arguments, from_arguments
from serving.engine import Engine
from serving.errors import Refused, add_error_handlers, error, invalid, shown
from serving.media import MediaPolicy
from serving.metrics import ServerMetrics
from serving.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    RequestLimits,
    completion_to_engine_request,
    to_engine_request,
)
from serving.requests import Output, TokenLogprobs
from serving.sequence import RequestState
from serving.stop_strings import StopMatcher, StopStrings

CHAT_PAGE = (Path(__file__).parent / "static" / "chat.html").read_text()
# the page's own inline script and style, and its images and videos as data URLs; nothing from anywhere else
PAGE_POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' "
               "data: blob:; media-src 'self' data: blob:; connect-src 'self'")


class Completion:
    """One request's samples as text: incremental detokenization, stop strings, finish reasons, and each
    token's log-probabilities in OpenAI's shape when the request asked for them."""

    def __init__(self, tokenizer, n: int, stop_strings: list[str], logprobs: bool = False) -> None:
        self.tokenizer = tokenizer
        stops = StopStrings(stop_strings)
        self.matchers = [StopMatcher(stops) for _ in range(n)]
        self.detokenizers = [IncrementalDetokenizer(tokenizer) for _ in range(n)]
        self.texts = [""] * n  # text sent so far
        self.finish_reasons: list[str | None] = [None] * n
        self.logprobs: list[list[dict]] | None = [[] for _ in range(n)] if logprobs else None

    def update(self, output: Output) -> list[str]:
        """Each sample's new text from `output` (held back while it might end in a cut character or the start
        of a stop string)."""
        deltas = []
        for i, new in enumerate(output.new_tokens):
            if self.finish_reasons[i]:
                deltas.append("")
                continue
            detokenizer, reason = self.detokenizers[i], output.finish_reasons[i]
            detokenizer.add(new)
            if self.logprobs is not None:
                self.logprobs[i] += [
                    self._logprob(token, entry) for token, entry in zip(new, output.logprobs[i])
                ]
            if reason is not None:
                detokenizer.finish()
            text, matcher = detokenizer.text, self.matchers[i]
            if (at := matcher.scan(text)) is not None:
                text, reason = text[:at], "stop"
            elif reason is None:
                text = text[: len(text) - matcher.held]
            self.finish_reasons[i] = reason
            deltas.append(text[len(self.texts[i]) :])
            self.texts[i] = text
        return deltas

    @property
    def done(self) -> bool:
        return all(self.finish_reasons)

    def _logprob(self, token: int, entry: TokenLogprobs) -> dict:
        """One token's entry of a choice's `logprobs.content`, as OpenAI's API gives it."""
        return {**self._token(token, entry.logprob),
                "top_logprobs": [self._token(other, logprob) for other, logprob in entry.top]}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def base_app(server_metrics: ServerMetrics, settings: ServingConfig, documented: bool,
             quantization: dict[str, str] | None = None) -> FastAPI:
    """The app with OpenAI's error replies and the open routes; its documentation pages only when `documented`
    (a server with an API key shows none)."""
    docs = {} if documented else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="tinyvlm", **docs)
    add_error_handlers(app)
    add_open_routes(app, server_metrics, settings, quantization or {})
    return app


def create_app(engine: AsyncEngine, tokenizer, model_name: str, default_max_tokens: int | None = None,
               limits: RequestLimits = RequestLimits(), media: MediaPolicy = MediaPolicy(),
               api_key: str | None = None, quantization: dict[str, str] | None = None) -> FastAPI:
    """The server's routes. default_max_tokens: for requests that set none (None: the rest of the context);
    quantization: what of the model is quantized (models/quantize.py `describe`), for /health."""
    server_metrics = ServerMetrics(engine.stats, model_name)
    app = base_app(server_metrics, engine.engine.settings, documented=api_key is None,
                   quantization=quantization)
    budget = BodyBudget(limits.max_buffered_bytes)
    preparing = asyncio.Semaphore(limits.max_preparing)
    workers = ThreadPoolExecutor(max_workers=min(8, limits.max_preparing), thread_name_prefix="prepare")
    prepare = functools.partial(prepare_request, engine=engine, tokenizer=tokenizer, model_name=model_name,
                                default_max_tokens=default_max_tokens, limits=limits, media=media)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_check(api_key))])
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tinyvlm"}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != model_name:
            raise unknown_model(model_id, model_name)
        return card

    async def serve(http: Request, chat: bool):
        arrival = time.monotonic()
        if engine.full:
            raise Refused(429, "too many requests in flight; try again later", "rate_limit_exceeded")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        async with read_body(http, limits, budget) as body, preparing:
            try:
                parsed, group, completion = await asyncio.get_running_loop().run_in_executor(
                    workers, prepare, body, request_id, chat
                )
                stream = engine.submit(group)
            except QueueFull as e:
                raise Refused(429, str(e), "rate_limit_exceeded") from None
            except TinyVLMError as e:
                raise Refused(400, str(e)) from None
        reply = Reply(engine, stream, completion, request_id,
                      {"id": request_id, "created": int(time.time()), "model": model_name}, group,
                      server_metrics, arrival, chat)
        if parsed.stream:
            usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return StreamingResponse(reply.events(usage), media_type="text/event-stream")
        return await reply.whole(http)

    @v1.post("/chat/completions")
    async def chat_completions(http: Request):
        return await serve(http, chat=True)

    @v1.post("/completions")
    async def completions(http: Request):
        return await serve(http, chat=False)

    app.include_router(v1)
    return app


def add_open_routes(app: FastAPI, server_metrics: ServerMetrics, settings: ServingConfig,
                    quantization: dict[str, str]) -> None:
    """The routes no API key guards: the chat page, /health (with the engine's resolved settings and, for a
    quantized model, what is quantized: {"language": "int8"}) and /metrics."""
    health_reply = {"status": "ok", **({"quantization": quantization} if quantization else {}),
                    "serving": settings.to_dict()}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        """The chat page: one static file that talks to this server's /v1/chat/completions."""
        return HTMLResponse(CHAT_PAGE, headers={"Content-Security-Policy": PAGE_POLICY})

    @app.get("/health")
    async def health() -> dict:
        return health_reply

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server_metrics.render(), media_type=CONTENT_TYPE_LATEST)


def bearer_check(api_key: str | None):
    """The /v1 routes' dependency: with an API key set, a request must send `Authorization: Bearer KEY`
    (401)."""

    async def authorize(http: Request) -> None:
        scheme, _, token = (http.headers.get("authorization") or "").partition(" ")
        if api_key and not (
            scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), api_key.encode())
        ):
            raise Refused(401, "invalid or missing API key (send the header Authorization: Bearer KEY)",
                          "invalid_api_key")

    return authorize


def unknown_model(asked: str, model_name: str) -> Refused:
    return Refused(404, f"the model `{shown(asked)}` does not exist (this server serves `{model_name}`)",
                   "model_not_found", "model")


def prepare_request(body: bytes | bytearray, request_id: str, chat: bool, *, engine: AsyncEngine, tokenizer,
                    model_name: str, default_max_tokens: int | None, limits: RequestLimits,
                    media: MediaPolicy) -> tuple[GenerationRequest, RequestState, Completion]:
    """Parse and check the request, fetch and decode its images, tokenize its prompt, set up its stop strings
    (in a worker thread)."""
    if body.count(b"{") + body.count(b"[") + body.count(b",") > limits.max_json_values:
        raise Refused(400, f"the request holds more than {limits.max_json_values} JSON objects, arrays and "
                           "items")
    try:
        parsed = (ChatRequest if chat else CompletionRequest).model_validate_json(body)
    except ValidationError as e:
        raise invalid(e) from None
    if parsed.model is not None and parsed.model != model_name:
        raise unknown_model(parsed.model, model_name)
    if chat:
        request = to_engine_request(parsed, default_max_tokens, limits, media, request_id)
    else:
        request = completion_to_engine_request(parsed, tokenizer, limits, request_id)
    group = engine.prepare(request)
    return parsed, group, Completion(tokenizer, parsed.n, parsed.stop_strings, chat and parsed.logprobs)


@dataclasses.dataclass
class Reply:
    """One submitted request's answer: its engine outputs as one chat.completion, or as server-sent chunks."""

    engine: AsyncEngine
    stream: asyncio.Queue
    completion: Completion
    request_id: str
    head: dict  # id, created, model: in every response body
    group: RequestState  # the engine's request: its prompt's length, and how much of it was found cached
    metrics: ServerMetrics
    arrival: float  # time.monotonic() when the request came in
    chat: bool  # a chat completion (messages, deltas), or a text completion (text)

    async def whole(self, http: Request) -> dict | JSONResponse:
        async for item in self.outputs(http):
            if isinstance(item, EngineFailure):
                return error(500, item.message, "server_error")
        completion, choices = self.completion, []
        for i, (text, reason) in enumerate(zip(completion.texts, completion.finish_reasons)):
            logprobs = None if completion.logprobs is None else {"content": completion.logprobs[i]}
            content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": i, **content, "finish_reason": reason, "logprobs": logprobs})
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": self.usage()}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        if self.chat:
            yield self.event([{"index": i, "delta": {"role": "assistant", "content": ""},
                               "finish_reason": None}
                              for i in range(len(self.completion.texts))])
        sent = [0] * len(self.completion.texts)  # log-probability entries sent, per sample
        async for item in self.outputs(None):
            if isinstance(item, EngineFailure):
                yield f"data: {json.dumps({'error': {'message': item.message, 'type': 'server_error'}})}\n\n"
                return
            deltas, reasons = item
            choices = []
            for i, (delta, reason) in enumerate(zip(deltas, reasons)):
                # log-probabilities of tokens whose text was held back go out with the next text
                if delta or reason:
                    content = ({"delta": {"content": delta} if delta else {}} if self.chat
                               else {"text": delta, "logprobs": None})
                    choice = {"index": i, **content, "finish_reason": reason}
                    if self.completion.logprobs is not None:
                        choice["logprobs"] = {"content": self.completion.logprobs[i][sent[i] :]}
                        sent[i] = len(self.completion.logprobs[i])
                    choices.append(choice)
            if choices:
                yield self.event(choices)
        if include_usage:
            yield self.event([], usage=self.usage())
        yield "data: [DONE]\n\n"

    def event(self, choices: list, **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return f"data: {json.dumps({**self.head, 'object': kind, 'choices': choices, **extra})}\n\n"

    def usage(self) -> dict:
        generated = sum(len(detokenizer.tokens) for detokenizer in self.completion.detokenizers)
        prompt = self.group.num_prompt
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": self.group.num_cached or 0}}

    async def outputs(self, http: Request | None):
        """Each step's (deltas, newly final reasons) until every sample is done; a request whose client goes
        away (`http` polled while nothing arrives) or whose samples all hit stop strings is aborted, freeing
        its blocks."""
        completion = self.completion
        finished = False
        last = None
        try:
            while not completion.done:
                try:
                    item = await asyncio.wait_for(self.stream.get(), timeout=0.5)
                except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
                    if http is not None and await http.is_disconnected():
                        return
                    continue
                if isinstance(item, EngineFailure):
                    finished = True
                    yield item
                    return
                now = time.monotonic()
                latency = (
                    self.metrics.time_to_first_token if last is None else self.metrics.inter_token_latency
                )
                latency.observe(now - (self.arrival if last is None else last))
                last = now
                before = list(completion.finish_reasons)
                deltas = completion.update(item)
                finished = item.finished
                yield deltas, [r if r != b else None for r, b in zip(completion.finish_reasons, before)]
            self.metrics.e2e_request_latency.observe(time.monotonic() - self.arrival)
            self.metrics.request_success.labels(self.metrics.model_name, completion.finish_reasons[0]).inc()
        finally:
            if not finished:  # the client went away, or stop strings ended every sample
                self.engine.abort(self.request_id)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint",
                        help="run or checkpoint directory, or a hub id (default: newest under runs/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quantize", choices=QUANTIZATIONS,
                        help="the language model's linears weight-only in int8 or int4 (torchao); "
                             "int8-dynamic: int8 activations too (a CPU's batches: float32's throughput, the "
                             "first token sooner)")
    parser.add_argument("--quantize-vision", action="store_true", help="with --quantize: the ViT's too")
    parser.add_argument("--model-name",
                        help="the model id clients use (default: the checkpoint's directory name)")
    parser.add_argument("--max-in-flight", type=int, default=256, help="requests admitted at once (then 429)")
    parser.add_argument("--api-key", default=os.environ.get("TINYVLM_API_KEY"),
                        help="require `Authorization: Bearer KEY` on every /v1 route (default: "
                             "$TINYVLM_API_KEY)")
    parser.add_argument("--allowed-local-media-path", type=Path,
                        help="serve local image files named by a request, but only under this directory "
                             "(default: none)")
    parser.add_argument("--allow-private-image-urls", action="store_true",
                        help="fetch image URLs from loopback, private and link-local addresses too")
    parser.add_argument("--max-request-mib", type=float, default=16, help="request body limit (MiB)")
    parser.add_argument("--max-image-mib", type=float, default=10, help="an image's encoded size limit (MiB)")
    parser.add_argument("--max-video-mib", type=float, default=64,
                        help="a video clip's encoded size limit (MiB)")
    parser.add_argument("--max-prompt-chars", type=int, default=100_000,
                        help="prompt length limit (characters)")
    parser.add_argument("--max-images", type=int, default=4, help="images per request")
    parser.add_argument("--max-stop-strings", type=int, default=16, help="stop strings per request")
    parser.add_argument("--max-stop-chars", type=int, default=256, help="a stop string's length limit")
    parser.add_argument("--max-buffered-mib", type=float, default=256,
                        help="request bodies held at once, in all (MiB; then 503)")
    parser.add_argument("--header-timeout", type=float, default=10,
                        help="seconds for a request's head to arrive (then the connection closes)")
    parser.add_argument("--body-timeout", type=float, default=30,
                        help="seconds for a request's body to arrive (then 408)")
    add_arguments(parser)
    return parser


def served_name(args: argparse.Namespace) -> str:
    """The model id clients use: --model-name, else the checkpoint directory's name."""
    return args.model_name or (Path(args.checkpoint).name if args.checkpoint else "tinyvlm")


def freeze_startup_heap() -> None:
    """Take every object alive once the server is set up (the model, the tokenizer, the modules) out
    of the garbage collector's walks (`gc.freeze`, as vLLM and SGLang do after start-up). A full collection
    holds the GIL while it walks the heap, and every stream and /health waits on it (1.3-4.4 s over the test
    suite's heap of 1.07M objects); frozen, it walks only what requests allocated since."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        import uvicorn

        from serving.connections import server_config

        config = from_arguments(args)
        model, processor = load_for_inference(args.checkpoint, pick_device(args.device),
                                              quantization=args.quantize,
                                              quantize_vision=args.quantize_vision)
    except ImportError:
        print("error: the server needs FastAPI and uvicorn: pip install -e .[serve]", file=sys.stderr)
        return 2
    except TinyVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.allowed_local_media_path and not args.allowed_local_media_path.is_dir():
        print(f"error: --allowed-local-media-path {args.allowed_local_media_path}: no such directory",
              file=sys.stderr)
        return 2
    try:
        engine = Engine(model, processor, config)
    except ValueError as e:  # settings that cannot run together here (--attention triton on a CPU, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"engine: {engine.settings.summary()}", file=sys.stderr, flush=True)
    print(f"weights: {weights_summary(model)}", file=sys.stderr, flush=True)
    async_engine = AsyncEngine(engine, args.max_in_flight,
                               log=lambda line: print(line, file=sys.stderr, flush=True))
    limits = RequestLimits(max_body_bytes=int(args.max_request_mib * 2**20), body_timeout=args.body_timeout,
                           max_buffered_bytes=int(args.max_buffered_mib * 2**20),
                           max_prompt_chars=args.max_prompt_chars, max_images=args.max_images,
                           max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars)
    media = MediaPolicy(args.allowed_local_media_path, args.allow_private_image_urls,
                        int(args.max_image_mib * 2**20), int(args.max_video_mib * 2**20),
                        video=model.config.video)
    app = create_app(async_engine, processor.tokenizer, served_name(args), limits=limits, media=media,
                     api_key=args.api_key, quantization=describe(model))
    freeze_startup_heap()
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, after uvicorn's graceful shutdown (as uvicorn.run)
        uvicorn.Server(server_config(app, args.host, args.port, args.header_timeout)).run()
    async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
