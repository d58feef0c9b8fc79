"""What the engine tracks per request: its settings, its samples (sequences) and their place in the KV cache."""

from __future__ import annotations

import dataclasses
import enum
import hashlib

import numpy as np
import torch
from torch import Tensor

from models.config import check
from models.errors import TinyVLMError
from models.sampling import SamplingParams
from serving.block_manager import TokenKey

MAX_LOGPROBS = 20  # top log-probabilities a request may ask for (OpenAI's limit)
STRUCTURES = ("json_schema", "json_object", "choice")


class RequestError(TinyVLMError, ValueError):
    """A request the engine cannot serve: longer than the context, larger than the whole KV cache, bad settings."""


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
    """Per-request settings (as vLLM's SamplingParams): sampling, `n` samples sharing one prefill, `max_tokens` (None:
    as many as fit the context after the prompt, and the KV cache), a `seed` for reproducible sampling, extra
    `stop_token_ids` (the model's own stop tokens always apply, unless `ignore_eos`, which benchmarks use to fix output
    lengths), `logprobs` (the log-softmax of the model's logits at each sampled token, and at the top k), `structure`
    (structured output)."""

    n: int = 1
    max_tokens: int | None = 64
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each sampled token's log-probability and the k most likely tokens'
    structure: Structure | None = None  # hold the answer to a JSON schema, any JSON object or a list of choices

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.n >= 1, f"n must be >= 1, got {self.n}")
        check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
              f"logprobs must lie in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclasses.dataclass
class TokenLogprobs:
    """A sampled token's log-probability under the model (the log-softmax of its logits) and the top k tokens'."""

    logprob: float
    top: list[tuple[int, float]]


class Status(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted: its blocks are free, its tokens recomputed on admission
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + generated tokens, how many of them are in the KV cache, its block table."""

    group: Group
    index: int  # which of the request's n samples
    tokens: list[int]
    keys: list[TokenKey]  # what identifies each token's K/V for prefix reuse (see serving/block_manager.py)
    table: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_registered: int = 0  # leading full blocks registered in the prefix cache (serving/block_manager.py)
    matcher: object | None = None  # its structured-output grammar's state (serving/structured.py), if constrained
    row: int | None = None  # its row of the runner's input buffers while it holds a seat (serving/input_buffers.py)
    finish_reason: str | None = None

    @property
    def num_prompt(self) -> int:
        return self.group.num_prompt

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def decoding(self) -> bool:
        """Its one pending token is a generated one (a prompt's tokens, placeholders included, run as a chunk)."""
        return self.num_computed >= self.group.num_prompt and len(self.tokens) - self.num_computed == 1

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.keys.append(token)


@dataclasses.dataclass(eq=False)
class Group:
    """A request: its prompt (token ids with image placeholders), images, settings and samples. Its prompt is
    prefilled once; the n samples then fork from it and share its blocks (copy-on-write)."""

    request_id: str
    prompt: list[int]
    images: Tensor | None  # [N, C, H, W] pixels, in placeholder order
    image_positions: np.ndarray  # the prompt positions of the image placeholders, ascending
    params: RequestParams
    stop_ids: frozenset[int]
    max_length: int  # a sample ends at this many tokens: prompt + max_tokens (within the context: checked)
    arrival: int  # order of arrival: the newest running request is the one preempted
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    features: Tensor | None = None  # the images' LM-space embeddings [image tokens, hidden], computed once
    num_cached: int | None = None  # prompt tokens found in the prefix cache at its first admission
    generator: torch.Generator | None = None
    grammar: object | None = None  # the compiled grammar of params.structure (serving/structured.py)
    forked: bool = False

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.sequences if s.finish_reason is None]

    @property
    def finished(self) -> bool:
        return self.forked and not self.live


def token_keys(prompt: list[int], images: Tensor | None, image_token_id: int | None) -> list[TokenKey]:
    """Prefix-cache keys of a prompt: token ids, and (digest of the image's pixels, index) for image tokens, so that
    two different images (or one image processed two ways) never share cached blocks."""
    digests = [] if images is None else [hashlib.sha256(image.float().cpu().numpy().tobytes()).hexdigest()
                                         for image in images]
    keys, seen = [], 0
    per_image = 0 if not digests else sum(t == image_token_id for t in prompt) // len(digests)
    for token in prompt:
        if token == image_token_id and digests:
            keys.append((digests[seen // per_image], seen % per_image))
            seen += 1
        else:
            keys.append(token)
    return keys
