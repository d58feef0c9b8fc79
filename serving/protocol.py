"""The OpenAI chat-completions request (the fields tinyvlm serves), checked, and turned into an engine
Request.

Every field is either honoured or refused: OpenAI fields this server cannot honour are accepted only at the
value that changes nothing (`tools: []`, `frequency_penalty: 0`, ...) and are otherwise a 400 naming the
field, as is any field the API does not have; `user` and `metadata` label a request and change nothing.

Every field is bounded (a 400 beyond): numbers to their ranges (a `seed` to 64 bits, as vLLM's), each list's
length (messages, content parts, `guided_choice` and its strings, stop strings by RequestLimits), names'
lengths; and before the body is parsed, the JSON values it holds.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from data import CAPTION_PROMPT, Message
from serving.errors import shown
from serving.media import MediaPolicy, open_image, open_video
from serving.requests import (
    MAX_LOGPROBS,
    MAX_TOP_K,
    SEED_RANGE,
    Request,
    RequestError,
    RequestParams,
    Structure,
)

MAX_N = 16
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 64  # of one message
MAX_CHOICES = 256  # guided_choice's strings ...
MAX_CHOICE_CHARS = 256  # ... and each one's length
MAX_NAME_CHARS = 256  # a model's name, a content part's type
CONTENT_TYPES = ("text", "image_url", "video_url")
LABELS = {"user", "metadata"}  # they name a request and change nothing
NEUTRAL = {  # fields the server cannot honour, with the values that ask for nothing it lacks
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []),
    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "functions": (None, []), "function_call": (None, "none", "auto"), "modalities": (None, ["text"]),
    "store": (None, False), "service_tier": (None, "auto", "default"),
}


class MediaURL(BaseModel):
    url: StrictStr


class ContentPart(BaseModel):
    type: StrictStr = Field(max_length=MAX_NAME_CHARS)  # one of CONTENT_TYPES, checked with a telling message
    text: StrictStr | None = None
    image_url: MediaURL | None = None
    video_url: MediaURL | None = None  # vLLM's video part: {"type": "video_url", "video_url": {"url": ...}}


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JSONSchema(BaseModel):
    name: StrictStr = "answer"
    schema_: dict = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class GenerationRequest(BaseModel):
    """What both APIs share. The fields tinyvlm honours are typed and checked here; any other field lands in
    `model_extra`, which `problem` judges against the API's NEUTRAL values."""

    model_config = ConfigDict(extra="allow")
    NEUTRAL: ClassVar[dict[str, tuple]] = NEUTRAL

    model: StrictStr | None = Field(default=None, max_length=MAX_NAME_CHARS)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=-1, le=MAX_TOP_K)  # vLLM's extension; 0 or -1 keep every token
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False  # vLLM's extension
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    guided_choice: list[Annotated[StrictStr, Field(max_length=MAX_CHOICE_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES)  # vLLM's extension

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def problem(self, limits: RequestLimits) -> str | None:
        """Why the request cannot be served as it is (a field this server cannot honour, stop strings beyond
        the limits), or None."""
        for name, value in (self.model_extra or {}).items():
            if name in LABELS:
                continue
            if name not in self.NEUTRAL:
                return f"{shown(name)}: not a field of this API that this server knows"
            if value not in self.NEUTRAL[name]:
                return f"{name}: {shown(repr(value))} is not supported by this server"
        stops = self.stop_strings
        if len(stops) > limits.max_stop_strings:
            return f"stop: {len(stops)} stop strings; at most {limits.max_stop_strings} allowed"
        if (longest := max(map(len, stops), default=0)) > limits.max_stop_chars:
            return f"stop: a stop string of {longest} characters; at most {limits.max_stop_chars} allowed"
        if not all(stops):
            return "stop: an empty stop string (it would end every answer before it starts)"
        return None

    def structure(self) -> Structure | None:
        """The structured output asked for: `response_format` JSON (a schema, or any object) or
        `guided_choice`."""
        kind = self.response_format.type if self.response_format else "text"
        if kind != "text" and self.guided_choice:
            raise RequestError("give response_format or guided_choice, not both")
        if self.guided_choice:
            return Structure("choice", tuple(self.guided_choice))
        if kind == "json_schema":
            if self.response_format.json_schema is None:
                raise RequestError("response_format: json_schema needs its json_schema.schema")
            return Structure("json_schema", json.dumps(self.response_format.json_schema.schema_))
        return Structure("json_object") if kind == "json_object" else None

    def params(self, max_tokens: int | None, logprobs: int | None = None) -> RequestParams:
        """The engine's settings for this request."""
        return RequestParams(greedy=self.temperature == 0, temperature=float(self.temperature) or 1.0,
                             top_p=float(self.top_p), top_k=max(self.top_k, 0), n=self.n, seed=self.seed,
                             ignore_eos=self.ignore_eos, logprobs=logprobs, max_tokens=max_tokens,
                             structure=self.structure())


class ChatRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: a plain text prompt (or its token ids), no chat template."""

    NEUTRAL: ClassVar[dict[str, tuple]] = {**NEUTRAL, "echo": (None, False), "suffix": (None, ""),
                                           "best_of": (None, 1), "logprobs": (None,)}

    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    max_tokens: StrictInt | None = Field(default=16, ge=1)  # the API's default

    def prompt_ids(self, tokenizer, max_chars: int) -> list[int]:
        """The prompt's token ids (the tokenizer's own special tokens added, as transformers' `encode` does);
        the engine checks token ids against the model's vocabulary."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise RequestError("prompt: one prompt per request (a list of prompts is not supported)")
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return list(prompt)
        if len(prompt) > max_chars:
            raise RequestError(f"the prompt has {len(prompt)} characters; at most {max_chars} are accepted")
        return tokenizer(prompt)["input_ids"]


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server, and what all of them may hold at once; beyond, a 4xx (or a
    503) before the work that would cost it."""

    max_body_bytes: int = 16 * 2**20  # checked before the body is read
    body_timeout: float = 30.0  # seconds for the whole body to arrive (then 408)
    max_buffered_bytes: int = 256 * 2**20  # bodies being read or waiting to be prepared, in all (then 503)
    max_prompt_chars: int = 100_000  # checked before tokenizing
    max_images: int = 4
    max_stop_strings: int = 16  # OpenAI takes 4
    max_stop_chars: int = 256  # each stop string's length
    # requests parsed, fetched or tokenized at once (others wait, read): bounds their images and tokens
    max_preparing: int = 32

    @property
    def max_json_values(self) -> int:
        """Objects, arrays and list items (or object members) a body may hold, counted from its `{`, `[` and
        `,` bytes before parsing (parsing runs under Python's lock, so a body of millions of `{}` or of stop
        strings would stall the server): a prompt's own brackets and commas count, so the bound is the prompt
        limit plus room for the request's structure."""
        return self.max_prompt_chars + 100_000


def to_engine_request(chat: ChatRequest, default_max_tokens: int | None, limits: RequestLimits,
                      media: MediaPolicy, request_id: str) -> Request:
    """The conversation (system / developer, user and assistant messages, images in any user message, or one
    video clip in the first user message, as SmolVLM2 places it) and its images in order or its clip's sampled
    frames, with the sampling settings; RequestError otherwise. The last message is the user's to answer; if
    it holds images and no text, it asks for a caption (generate.py's caption prompt)."""
    if problem := chat.problem(limits):
        raise RequestError(problem)
    if chat.top_logprobs and not chat.logprobs:
        raise RequestError("top_logprobs: needs logprobs: true")
    messages, urls, videos = [], [], []
    for i, message in enumerate(chat.messages):
        if message.role == "tool":
            raise RequestError(f"messages.{i}: tool messages are not supported (this server calls no tools)")
        parts = [ContentPart(type="text", text=message.content)] if isinstance(message.content, str) else \
            message.content
        texts, images = [], []
        for j, part in enumerate(parts):
            if part.type not in CONTENT_TYPES:
                raise RequestError(f"messages.{i}.content.{j}: content part type {shown(part.type)!r} is not "
                                   f"supported; this server takes {', '.join(map(repr, CONTENT_TYPES))} "
                                   "parts")
            if part.type == "text":
                texts.append(part.text or "")
            elif part.type == "video_url":
                if part.video_url is None:
                    raise RequestError(f"messages.{i}: a video_url content part needs a video_url object")
                if message.role != "user" or any(m.role == "user" for m in messages):
                    raise RequestError(f"messages.{i}: a video goes in the first user message")
                videos.append(part.video_url.url)
            elif part.image_url is None:
                raise RequestError(f"messages.{i}: an image_url content part needs an image_url object")
            else:
                images.append(part.image_url.url)
        if images and message.role != "user":
            raise RequestError(f"messages.{i}: only user messages may hold images")
        role = "system" if message.role == "developer" else message.role
        messages.append(Message(role, "\n".join(texts), len(images)))
        urls += images
    last = messages[-1]
    if last.role != "user":
        raise RequestError("the last message must be the user's (the one to answer)")
    if not last.text.strip():
        if not last.images and not (videos and last is next(m for m in messages if m.role == "user")):
            raise RequestError("the last message has no text and no image")
        messages[-1] = dataclasses.replace(last, text=CAPTION_PROMPT)
    if (chars := sum(len(message.text) for message in messages)) > limits.max_prompt_chars:
        raise RequestError(f"the messages hold {chars} characters; at most {limits.max_prompt_chars} are "
                           "accepted")
    if len(urls) > limits.max_images:
        raise RequestError(f"{len(urls)} images in one request; at most {limits.max_images} are accepted")
    if videos and (len(videos) > 1 or urls):
        raise RequestError("a request holds one video and no images beside it (its frames are the images)")
    params = chat.params(chat.max_completion_tokens or chat.max_tokens or default_max_tokens,
                         (chat.top_logprobs or 0) if chat.logprobs else None)
    return Request(messages, [open_image(url, i, media) for i, url in enumerate(urls)] or None, params,
                   request_id, open_video(videos[0], 0, media) if videos else None)


def completion_to_engine_request(completion: CompletionRequest, tokenizer, limits: RequestLimits,
                                 request_id: str) -> Request:
    """A text completion's prompt as token ids, with the sampling settings; RequestError otherwise."""
    if problem := completion.problem(limits):
        raise RequestError(problem)
    return Request(completion.prompt_ids(tokenizer, limits.max_prompt_chars), None,
                   completion.params(completion.max_tokens), request_id)
