"""An OpenAI-compatible HTTP server for a tinyvlm checkpoint (FastAPI + uvicorn: `pip install -e .[serve]`).

    python -m serving.server --checkpoint runs/tiny --host 127.0.0.1 --port 8000

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="tinyvlm", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What color is the circle?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}])

Endpoints: POST /v1/chat/completions (streaming as server-sent events, `n`, `max_tokens`, `temperature`, `top_p`,
`seed`, `stop`, `stream_options.include_usage`), GET /v1/models, /health and /metrics (running and waiting requests,
KV blocks used, prefix-cache hit rate). A client that disconnects aborts its request; bad requests get a 4xx JSON
error, and a full server answers 429.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from data.chat_processors import load_for_inference
from data.detokenizer import IncrementalDetokenizer
from models.checkpoints import pick_device
from models.errors import TinyVLMError
from serving.async_engine import AsyncEngine, EngineFailure, QueueFull
from serving.engine import Engine, Output, engine_size
from serving.protocol import ChatRequest, to_engine_request


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


class Completion:
    """One request's samples as text: incremental detokenization, stop strings, finish reasons."""

    def __init__(self, tokenizer, n: int, stop_strings: list[str]) -> None:
        self.stop_strings = stop_strings
        self.longest_stop = max(map(len, stop_strings), default=0)
        self.detokenizers = [IncrementalDetokenizer(tokenizer) for _ in range(n)]
        self.texts = [""] * n  # text sent so far
        self.finish_reasons: list[str | None] = [None] * n

    def update(self, output: Output) -> list[str]:
        """Each sample's new text from `output` (held back while it might end in a cut character or a stop string)."""
        deltas = []
        for i, new in enumerate(output.new_tokens):
            if self.finish_reasons[i]:
                deltas.append("")
                continue
            detokenizer, reason = self.detokenizers[i], output.finish_reasons[i]
            detokenizer.add(new)
            if reason is not None:
                detokenizer.finish()
            text = detokenizer.text
            # a stop string not found before overlaps the text not yet sent
            start = max(0, len(self.texts[i]) - self.longest_stop + 1)
            for stop in self.stop_strings:  # the earliest stop string wins
                if (at := text.find(stop, start)) >= 0:
                    text, reason = text[:at], "stop"
            if reason is None:  # hold back what could be the start of a stop string
                held = max((k for stop in self.stop_strings for k in range(1, len(stop)) if text.endswith(stop[:k])),
                           default=0)
                text = text[: len(text) - held]
            self.finish_reasons[i] = reason
            deltas.append(text[len(self.texts[i]) :])
            self.texts[i] = text
        return deltas

    @property
    def done(self) -> bool:
        return all(self.finish_reasons)


def create_app(engine: AsyncEngine, tokenizer, model_name: str, default_max_tokens: int = 256,
               max_images: int = 4) -> FastAPI:
    app = FastAPI(title="tinyvlm")
    app.add_exception_handler(RequestValidationError, invalid_request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        return engine.stats()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "tinyvlm"}]}

    @app.post("/v1/chat/completions")
    async def chat(chat_request: ChatRequest, http: Request):
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            request = await asyncio.to_thread(to_engine_request, chat_request, default_max_tokens, max_images,
                                              request_id)
            group, stream = engine.submit(request)
        except QueueFull as e:
            return error(429, str(e), "rate_limit_error")
        except TinyVLMError as e:
            return error(400, str(e))
        reply = Reply(engine, stream, Completion(tokenizer, chat_request.n, chat_request.stop_strings), request_id,
                      {"id": request_id, "created": int(time.time()), "model": chat_request.model or model_name},
                      group.num_prompt)
        if chat_request.stream:
            include_usage = bool(chat_request.stream_options and chat_request.stream_options.include_usage)
            return StreamingResponse(reply.events(include_usage), media_type="text/event-stream")
        return await reply.whole(http)

    return app


async def invalid_request(_, exc: RequestValidationError) -> JSONResponse:
    """A request the protocol's models refuse: a 400 naming the field, as OpenAI's API answers."""
    problem = exc.errors()[0] if exc.errors() else {}
    if problem.get("type") == "json_invalid":
        return error(400, "the request body is not valid JSON")
    where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body")
    return error(400, f"{where + ': ' if where else ''}{problem.get('msg', 'invalid request')}")


@dataclasses.dataclass
class Reply:
    """One submitted request's answer: its engine outputs as one chat.completion, or as server-sent chunks."""

    engine: AsyncEngine
    stream: asyncio.Queue
    completion: Completion
    request_id: str
    head: dict  # id, created, model: in every response body
    prompt_tokens: int

    async def whole(self, http: Request) -> dict | JSONResponse:
        async for item in self.outputs(http):
            if isinstance(item, EngineFailure):
                return error(500, item.message, "server_error")
        choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                   for i, (text, reason) in enumerate(zip(self.completion.texts, self.completion.finish_reasons))]
        return {**self.head, "object": "chat.completion", "choices": choices, "usage": self.usage()}

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        yield self.event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                          for i in range(len(self.completion.texts))])
        async for item in self.outputs(None):
            if isinstance(item, EngineFailure):
                yield f"data: {json.dumps({'error': {'message': item.message, 'type': 'server_error'}})}\n\n"
                return
            deltas, reasons = item
            choices = [{"index": i, "delta": {"content": delta} if delta else {}, "finish_reason": reason}
                       for i, (delta, reason) in enumerate(zip(deltas, reasons)) if delta or reason]
            if choices:
                yield self.event(choices)
        if include_usage:
            yield self.event([], usage=self.usage())
        yield "data: [DONE]\n\n"

    def event(self, choices: list, **extra) -> str:
        return f"data: {json.dumps({**self.head, 'object': 'chat.completion.chunk', 'choices': choices, **extra})}\n\n"

    def usage(self) -> dict:
        generated = sum(len(detokenizer.tokens) for detokenizer in self.completion.detokenizers)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": generated,
                "total_tokens": self.prompt_tokens + generated}

    async def outputs(self, http: Request | None):
        """Each step's (deltas, newly final reasons) until every sample is done; a request whose client goes away
        (`http` polled while nothing arrives) or whose samples all hit stop strings is aborted, freeing its blocks."""
        completion, finished = self.completion, False
        try:
            while not completion.done:
                try:
                    item = await asyncio.wait_for(self.stream.get(), timeout=0.5)
                except TimeoutError:
                    if http is not None and await http.is_disconnected():
                        return
                    continue
                if isinstance(item, EngineFailure):
                    finished = True
                    yield item
                    return
                before = list(completion.finish_reasons)
                deltas = completion.update(item)
                finished = item.finished
                yield deltas, [r if r != b else None for r, b in zip(completion.finish_reasons, before)]
        finally:
            if not finished:  # the client went away, or stop strings ended every sample
                self.engine.abort(self.request_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="run or checkpoint directory, or a hub id (default: newest under runs/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model-name", help="the model id clients use (default: the checkpoint's directory name)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="KV-cache memory (MiB)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--max-in-flight", type=int, default=256, help="requests admitted at once (then 429)")
    parser.add_argument("--attention", choices=["auto", "gather", "triton"], default="auto",
                        help="paged attention: gather + SDPA, or the Triton kernel over the pool in place "
                             "(auto: Triton on a GPU)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for the decode step (as vLLM's)")
    args = parser.parse_args(argv)
    try:
        import uvicorn

        model, processor = load_for_inference(args.checkpoint, pick_device(args.device))
    except ImportError:
        print("error: the server needs FastAPI and uvicorn: pip install -e .[serve]", file=sys.stderr)
        return 2
    except TinyVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = Engine(model, processor, **engine_size(model, args.kv_cache_mib, max_num_seqs=args.max_num_seqs),
                    attention=args.attention, cuda_graphs=False if args.enforce_eager else None)
    name = args.model_name or (Path(args.checkpoint).name if args.checkpoint else "tinyvlm")
    async_engine = AsyncEngine(engine, args.max_in_flight, log=lambda line: print(line, file=sys.stderr, flush=True))
    uvicorn.run(create_app(async_engine, processor.tokenizer, name), host=args.host, port=args.port)
    async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
