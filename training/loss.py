"""How the answer tokens of a batch share its loss."""

from __future__ import annotations

from typing import Literal

import torch

from data import IGNORE_INDEX

LossWeight = Literal["token", "square", "sample"]
_EXPONENT = {"token": 0.0, "square": 0.5, "sample": 1.0}


def target_weights(targets: torch.Tensor, per: LossWeight) -> torch.Tensor:
    """Each position's weight in the loss, [B, T], 0 where there is no target. For a sample with n answer tokens:
    token: 1 per token (a 40-token caption weighs 40 one-word answers); sample: 1/n (each sample weighs alike);
    square: 1/sqrt(n) (in between; InternVL 2.5's "square averaging")."""
    weights = (targets != IGNORE_INDEX).float()
    return weights / weights.sum(-1, keepdim=True).clamp(min=1) ** _EXPONENT[per]
