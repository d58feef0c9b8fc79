"""The OpenAI chat-completions request (the fields tinyvlm serves), checked, and turned into an engine Request.

Every field is either honoured or refused: OpenAI fields this server cannot honour are accepted only at the value that
changes nothing (`tools: []`, `frequency_penalty: 0`, ...) and are otherwise a 400 naming the field,
as is any field the API does not have; `user` and `metadata` label a request and change nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from data import CAPTION_PROMPT
from serving.engine import Request, RequestError
from serving.media import MediaPolicy, open_image
from serving.sequence import MAX_LOGPROBS, RequestParams

MAX_N = 16
LABELS = {"user", "metadata"}  # they name a request and change nothing
NEUTRAL = {  # fields the server cannot honour, with the values that ask for nothing it lacks
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "response_format": (None, {"type": "text"}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False), "functions": (None, []),
    "function_call": (None, "none", "auto"), "modalities": (None, ["text"]), "store": (None, False),
    "service_tier": (None, "auto", "default"),
}


class ImageURL(BaseModel):
    url: StrictStr


class ContentPart(BaseModel):
    type: Literal["text", "image_url"]
    text: StrictStr | None = None
    image_url: ImageURL | None = None


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    """The fields tinyvlm honours are typed and checked here; any other field lands in `model_extra`, which
    `refused_field` judges."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=-1)  # vLLM's extension; 0 or -1 keep every token
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False  # vLLM's extension
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def refused_field(self) -> str | None:
        """Why a field of the request cannot be honoured, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in LABELS:
                continue
            if name not in NEUTRAL:
                return f"{name}: not a field of the chat completions API that this server knows"
            if value not in NEUTRAL[name]:
                return f"{name}: {value!r} is not supported by this server"
        return None


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server; beyond, a 4xx before the work that would cost it."""

    max_body_bytes: int = 16 * 2**20  # checked before the body is read
    max_prompt_chars: int = 100_000  # checked before tokenizing
    max_images: int = 4
    max_preparing: int = 32  # requests read, parsed, fetched or tokenized at once (others wait, unread): bounds memory

    @property
    def max_json_containers(self) -> int:
        """Objects and arrays a body may hold, counted from its `{` and `[` bytes before parsing (parsing runs under
        Python's lock, so a body of millions of `{}` would stall the server): a prompt's own brackets count, so the
        bound is the prompt limit plus room for the request's structure."""
        return self.max_prompt_chars + 10_000


def to_engine_request(chat: ChatRequest, default_max_tokens: int | None, limits: RequestLimits, media: MediaPolicy,
                      request_id: str) -> Request:
    """The single user turn's text and images (in order), with the sampling settings; RequestError otherwise. An
    image with no text asks for a caption (generate.py's caption prompt)."""
    if refused := chat.refused_field():
        raise RequestError(refused)
    if chat.top_logprobs and not chat.logprobs:
        raise RequestError("top_logprobs: needs logprobs: true")
    if len(chat.messages) != 1 or chat.messages[0].role != "user":
        raise RequestError("only a single user message is supported (no system, assistant or multi-turn messages)")
    content = chat.messages[0].content
    parts = [ContentPart(type="text", text=content)] if isinstance(content, str) else content
    texts, images = [], []
    for part in parts:
        if part.type == "text":
            texts.append(part.text or "")
        elif part.image_url is None:
            raise RequestError("an image_url content part needs an image_url object")
        else:
            images.append(part.image_url.url)
    text = "\n".join(texts)
    if len(text) > limits.max_prompt_chars:
        raise RequestError(f"the prompt has {len(text)} characters; at most {limits.max_prompt_chars} are accepted")
    if len(images) > limits.max_images:
        raise RequestError(f"{len(images)} images in one message; at most {limits.max_images} are accepted")
    if not text.strip():
        if not images:
            raise RequestError("the message has no text and no image")
        text = CAPTION_PROMPT
    params = RequestParams(greedy=chat.temperature == 0, temperature=float(chat.temperature) or 1.0,
                           top_p=float(chat.top_p), top_k=max(chat.top_k, 0), n=chat.n, seed=chat.seed,
                           ignore_eos=chat.ignore_eos, logprobs=(chat.top_logprobs or 0) if chat.logprobs else None,
                           max_tokens=chat.max_completion_tokens or chat.max_tokens or default_max_tokens)
    return Request(text, [open_image(url, i, media) for i, url in enumerate(images)] or None, params, request_id)
