"""A step's rows sampled in one call, each with its own settings (the serving engine's batches of requests),
through the same filter and race as `generate` (models/sampling.py), so that a seeded row gets generate's
token."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from models.sampling import filter_logits, race


@dataclasses.dataclass
class RowSettings:
    """Each row's sampling settings as tensors on the logits' device (a batch of requests, one step of the
    engine). top_k / top_p are plain 0 / 1.0 when no row of the batch uses them (the host knows), so that work
    is skipped."""

    greedy: Tensor  # [B] bool
    temperature: Tensor  # [B, 1] float32, 1 on greedy rows
    top_k: Tensor | int = 0  # [B, 1] int64, 0 keeps every token
    top_p: Tensor | float = 1.0  # [B, 1] float32, 1 keeps every token


def sample_rows(logits: Tensor, settings: RowSettings, noise: Tensor) -> Tensor:
    """One token id per row of `logits` [B, V], each row with its own settings and exponential `noise` [B, V]
    (a row drawn from the same generator as `sample` draws it gets the same token): one call for a whole
    batch."""
    probs = filter_logits(logits.float() / settings.temperature, settings.top_k, settings.top_p).softmax(-1)
    return torch.where(settings.greedy, logits.argmax(-1), race(probs, noise))
