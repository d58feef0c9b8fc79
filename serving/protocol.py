"""The OpenAI chat-completions request (the fields tinyvlm serves), checked, and turned into an engine Request."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from data import load_image
from serving.engine import Request, RequestError
from serving.sequence import RequestParams

MAX_N = 16


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
    """Fields the OpenAI API has and tinyvlm does not use are accepted and ignored; the ones it uses are checked."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def to_engine_request(chat: ChatRequest, default_max_tokens: int, max_images: int, request_id: str) -> Request:
    """The single user turn's text and images (in order), with the sampling settings; RequestError otherwise."""
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
    if len(images) > max_images:
        raise RequestError(f"{len(images)} images in one message; at most {max_images} are accepted")
    text = "\n".join(texts)
    if not text.strip():
        raise RequestError("the message has no text")
    params = RequestParams(greedy=chat.temperature == 0, temperature=float(chat.temperature) or 1.0,
                           top_p=float(chat.top_p), n=chat.n, seed=chat.seed,
                           max_tokens=chat.max_completion_tokens or chat.max_tokens or default_max_tokens)
    return Request(text, [open_image(url, i) for i, url in enumerate(images)] or None, params, request_id)


def open_image(url: str, index: int):
    """A base64 data URL or a local file (path or file:// URL); remote URLs are refused (the server is offline)."""
    if url.startswith(("http://", "https://")):
        raise RequestError(f"image {index}: remote image URLs are not fetched; send the image as a base64 data URL")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise RequestError(f"image {index}: a data URL must be base64-encoded (data:image/png;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"image {index}: invalid base64 data") from None
        source = io.BytesIO(data)
        source.name = f"image {index}"
        return load_image(source)
    return load_image(Path(url.removeprefix("file://")))
