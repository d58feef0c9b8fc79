"""Loss weighting: per token or per sample, in training and in the validation loss."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.models.helpers import tiny_vlm
from training.evaluate import validation_loss
from training.loss import target_weights


def test_each_sample_weighs_one_or_each_token_does():
    targets = torch.tensor([[-100, 5, 6, 7, -100], [-100, -100, 8, -100, -100], [-100] * 5])
    rows = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    assert target_weights(targets, rows, "token").tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0] * 5]
    torch.testing.assert_close(target_weights(targets, rows, "sample").sum(-1), torch.tensor([1.0, 1.0, 0.0]))
    assert target_weights(targets, rows, "sample")[0].tolist() == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 0])


def test_packed_samples_are_weighed_one_by_one():
    """Two samples packed into one row (mask 1, 1, 1, 2, 2, 0) weigh as they do in rows of their own."""
    targets = torch.tensor([[-100, 5, 6, -100, 7, -100]])
    sequences = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert target_weights(targets, sequences, "sample").tolist() == [[0, 0.5, 0.5, 0, 1, 0]]
    assert target_weights(targets, sequences, "square")[0].tolist() == pytest.approx(
        [0, 2**-0.5, 2**-0.5, 0, 1, 0]
    )


@pytest.mark.parametrize("per", ["token", "sample"])
def test_validation_loss_weighs_like_training(per):
    model = tiny_vlm().eval()
    generator = torch.Generator().manual_seed(1)
    batches, rows = [], []
    for answer_lengths in ([6, 1], [2]):
        ids = torch.randint(3, 90, (len(answer_lengths), 12), generator=generator)
        targets = torch.full_like(ids, -100)
        for row, n in enumerate(answer_lengths):
            targets[row, 11 - n : 11] = ids[row, 12 - n :]
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "targets": targets})
        with torch.no_grad():
            logits, _ = model(ids)
        rows += [(row_logits[row_targets != -100], row_targets[row_targets != -100])
                 for row_logits, row_targets in zip(logits, targets)]
    if per == "token":
        expected = F.cross_entropy(torch.cat([z for z, _ in rows]), torch.cat([t for _, t in rows]))
    else:
        expected = torch.stack([F.cross_entropy(z, t) for z, t in rows]).mean()
    got = validation_loss(model, batches, torch.device("cpu"), contextlib.nullcontext(), per)
    assert got == pytest.approx(expected.item(), rel=1e-5)
