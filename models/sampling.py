"""Next-token sampling on the device: temperature, then top-k, then top-p (nucleus; Holtzman et al. 2019)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from typed_config import Config, check


@dataclasses.dataclass
class SamplingParams(Config):
    """How to pick each next token (as vLLM's SamplingParams): greedy, or temperature -> top-k -> top-p
    sampling."""

    greedy: bool = False
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1 keeps every token

    def __post_init__(self) -> None:
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        check(0 < self.top_p <= 1, f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def filter_logits(logits: Tensor, top_k: int | Tensor = 0, top_p: float | Tensor = 1.0) -> Tensor:
    """Logits [B, V] with everything outside the top-k, then outside the top-p nucleus, set to -inf; top_k and
    top_p are one value for every row, or one per row ([B, 1]) where 0 and 1 leave that row as it is.

    The nucleus is the smallest set of most probable tokens whose probability mass reaches top_p."""
    vocab = logits.shape[-1]
    if isinstance(top_k, Tensor):
        kth_largest = logits.sort(-1, descending=True).values.gather(-1, (top_k - 1).clamp(0, vocab - 1))
        logits = logits.masked_fill((logits < kth_largest) & (top_k > 0), float("-inf"))
    elif 0 < top_k < vocab:
        kth_largest = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if isinstance(top_p, Tensor) or top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        if isinstance(top_p, Tensor):
            drop_sorted &= top_p < 1
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def race(probs: Tensor, noise: Tensor) -> Tensor:
    """argmax(p / E) with E ~ Exp(1) (`noise`, like probs) draws from p (the exponential race), with no host
    sync unlike torch.multinomial."""
    return (probs / noise).argmax(-1)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of `logits` [B, V], every row with the same settings, without a host sync."""
    if params.is_greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p).softmax(-1)
    return race(probs, torch.empty_like(probs).exponential_(1, generator=generator))
