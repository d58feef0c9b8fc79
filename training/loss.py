"""How the answer tokens of a batch share its loss."""

from __future__ import annotations

from typing import Literal

import torch

from data import IGNORE_INDEX

LossWeight = Literal["token", "square", "sample"]
_EXPONENT = {"token": 0.0, "square": 0.5, "sample": 1.0}


def target_weights(targets: torch.Tensor, sequences: torch.Tensor, per: LossWeight) -> torch.Tensor:
    """Each position's weight in the loss, [B, T], 0 where there is no target. `sequences` is the batch's
    attention mask: which sample of its row each position belongs to (1, 2, ... in packed rows; 0 for
    padding). For a sample with n answer tokens: token: 1 per token (a 40-token caption weighs 40 one-word
    answers); sample: 1/n (each sample weighs alike); square: 1/sqrt(n) (in between; InternVL 2.5's "square
    averaging")."""
    weights = (targets != IGNORE_INDEX).float()
    sequences = sequences.long()
    per_sample = torch.zeros(sequences.shape[0], sequences.shape[1] + 1,
                             device=weights.device).scatter_add_(1, sequences, weights)
    return weights / per_sample.gather(1, sequences).clamp(min=1) ** _EXPONENT[per]
