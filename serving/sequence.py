"""What the engine tracks per request: its samples (sequences), their state and their place in the KV
cache."""

from __future__ import annotations

import dataclasses
import enum
import hashlib

import numpy as np
import torch
from torch import Tensor

from serving.block_manager import TokenKey
from serving.requests import RequestParams


class Status(enum.Enum):
    # not yet admitted, or preempted: its blocks are free, its tokens recomputed on admission
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request: prompt + generated tokens, how many of them are in the KV cache, its block
    table."""

    group: RequestState
    index: int  # which of the request's n samples
    tokens: list[int]
    keys: list[TokenKey]  # what identifies each token's K/V for prefix reuse (see serving/block_manager.py)
    table: list[int] = dataclasses.field(default_factory=list)
    hashes: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_registered: int = 0  # leading full blocks registered in the prefix cache (serving/block_manager.py)
    # its structured-output grammar's state (serving/structured.py), if constrained
    matcher: object | None = None
    # its row of the runner's input buffers while it holds a seat (serving/input_buffers.py)
    row: int | None = None
    finish_reason: str | None = None
    # tokens sampled on the device that the host has not read yet (an overlapped step's: 1 between steps, 2
    # while the next step launches); a decode reads the last one from the device by seat
    # (serving/input_buffers.py)
    unread: int = 0

    @property
    def num_prompt(self) -> int:
        return self.group.num_prompt

    @property
    def num_tokens(self) -> int:
        """Its tokens, those not read yet included."""
        return len(self.tokens) + self.unread

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def decoding(self) -> bool:
        """Its one pending token is a generated one (a prompt's tokens, placeholders included, run as a
        chunk)."""
        return self.num_computed >= self.group.num_prompt and self.num_pending == 1

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.keys.append(token)


@dataclasses.dataclass(eq=False)
class RequestState:
    """A request as the engine holds it: its prompt (token ids with image placeholders), images, settings and
    samples. Its prompt is prefilled once; the n samples then fork from it and share its blocks
    (copy-on-write)."""

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
    """Prefix-cache keys of a prompt: token ids, and (digest of the image's pixels, index) for image tokens,
    so that two different images (or one image processed two ways) never share cached blocks."""
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
