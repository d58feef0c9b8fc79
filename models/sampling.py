"""Next-token sampling on the device: temperature, then top-k, then top-p (nucleus; Holtzman et al. 2019)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from models.config import Config, check


@dataclasses.dataclass
class SamplingParams(Config):
    """How to pick each next token (as vLLM's SamplingParams): greedy, or temperature -> top-k -> top-p sampling."""

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


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Logits [B, V] with everything outside the top-k, then outside the top-p nucleus, set to -inf.

    The nucleus is the smallest set of most probable tokens whose probability mass reaches top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of `logits` [B, V], without a host sync."""
    if params.is_greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), with no sync unlike torch.multinomial.
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(-1)
