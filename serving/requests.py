"""A request's types, as a caller of the engine (or the server) sees them: the request, its settings and its
refusal, and what comes back: a step's output, a whole result, log-probabilities."""

from __future__ import annotations

import dataclasses

from PIL import Image
from torch import Tensor

from data.prompts import Message
from data.video import Clip
from models.errors import TinyVLMError
from models.sampling import SamplingParams
from typed_config import check

MAX_LOGPROBS = 20  # top log-probabilities a request may ask for (OpenAI's limit)
SEED_RANGE = (-(2**63), 2**63 - 1)  # torch's generators take 64 bits (vLLM's bound)
MAX_TOP_K = 2**31 - 1  # any k beyond the vocabulary keeps every token
STRUCTURES = ("json_schema", "json_object", "choice")


class RequestError(TinyVLMError, ValueError):
    """A request the engine cannot serve: longer than the context, larger than the whole KV cache, bad
    settings."""


@dataclasses.dataclass(frozen=True)
class Structure:
    """What an answer must be (serving/structured.py): "json_schema" (`spec` the schema, as JSON text),
    "json_object" (any JSON object), or "choice" (`spec` the allowed answers)."""

    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURES:
            raise RequestError(f"structured output must be one of {STRUCTURES}, got {self.kind!r}")
        if self.kind == "choice" and not (self.spec and all(isinstance(c, str) and c for c in self.spec)):
            raise RequestError("a choice needs a non-empty list of non-empty strings")


@dataclasses.dataclass
class RequestParams(SamplingParams):
    """Per-request settings (as vLLM's SamplingParams): sampling, `n` samples sharing one prefill,
    `max_tokens` (None: as many as fit the context after the prompt, and the KV cache), a `seed` for
    reproducible sampling, extra `stop_token_ids` (the model's own stop tokens always apply, unless
    `ignore_eos`, which benchmarks use to fix output lengths), `logprobs` (the log-softmax of the model's
    logits at each sampled token, and at the top k), `structure` (structured output)."""

    n: int = 1
    max_tokens: int | None = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: none; k: each sampled token's log-probability and the k most likely tokens'
    logprobs: int | None = None
    # hold the answer to a JSON schema, any JSON object or a list of choices
    structure: Structure | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.n >= 1, f"n must be >= 1, got {self.n}")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
              f"logprobs must lie in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        check(self.max_tokens is None or self.max_tokens >= 1,
              f"max_tokens must be >= 1, got {self.max_tokens}")
        # checked here, not when a step seats the request (where one out of range failed every request)
        check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
              f"seed must lie in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {self.seed}")
        check(self.top_k <= MAX_TOP_K, f"top_k must be <= {MAX_TOP_K}, got {self.top_k}")


@dataclasses.dataclass
class TokenLogprobs:
    """A sampled token's log-probability under the model (the log-softmax of its logits) and the top k
    tokens'."""

    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Request:
    """A prompt (text: one user turn; a conversation: data.Message's, each user message with its number of
    images; or token ids with image placeholders already in place) with its images (PIL images, in order, or
    processed pixels [N, C, H, W] for token ids) and settings. A text prompt may instead take a `video`
    (data/video.py's sampled frames, no images beside it): its frames open the first user message, each one
    image, as the processor writes a clip."""

    prompt: str | list[Message] | list[int]
    images: list[Image.Image] | Tensor | None = None
    params: RequestParams = dataclasses.field(default_factory=RequestParams)
    request_id: str | None = None
    video: Clip | None = None


@dataclasses.dataclass
class Output:
    """What a step produced for one request: each sample's new tokens (and their log-probabilities, if asked
    for), and, once finished, each sample's reason ("stop": a stop token, included in its tokens; "length":
    max_tokens or the context)."""

    request_id: str
    new_tokens: list[list[int]]
    finished: bool = False
    finish_reasons: list[str | None] = dataclasses.field(default_factory=list)
    logprobs: list[list[TokenLogprobs]] | None = None


@dataclasses.dataclass
class Result:
    request_id: str
    token_ids: list[list[int]]  # per sample
    texts: list[str]
    finish_reasons: list[str]
    prompt_tokens: int
    cached_tokens: int  # of the prompt's, found in the prefix cache when it was admitted
    logprobs: list[list[TokenLogprobs]] | None = None  # per sample, per token (RequestParams.logprobs)
