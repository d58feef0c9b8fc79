"""The chunked head + cross-entropy computes what `F.cross_entropy(hidden @ weight.T)` does, in float32 and
under autocast, and keeps no [positions, vocabulary] tensor for the backward pass."""

import pytest
import torch
import torch.nn.functional as F

from models import linear_cross_entropy as module
from models.linear_cross_entropy import linear_cross_entropy


def _inputs(positions=37, width=16, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(positions, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,), generator=generator)
    targets[::5] = -100
    row_weights = torch.rand(positions, generator=generator)  # a training step's per-token loss weights
    return hidden, weight, targets, row_weights


def _losses_and_grads(losses_of, hidden, weight, targets, row_weights):
    hidden.grad = weight.grad = None
    losses = losses_of(hidden, weight, targets)
    (losses * row_weights.to(losses.dtype)).sum().backward()
    return losses.detach(), hidden.grad.clone(), weight.grad.clone()


def _float64_reference(hidden, weight, targets):
    return F.cross_entropy(hidden.double() @ weight.double().T, targets, reduction="none")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 8 * 50)  # 37 positions, V 50: four chunks of 8 and one of 5


def test_losses_and_gradients_equal_a_float64_reference():
    hidden, weight, targets, row_weights = _inputs()
    got = _losses_and_grads(linear_cross_entropy, hidden, weight, targets, row_weights)
    reference = _losses_and_grads(_float64_reference, hidden, weight, targets, row_weights)
    assert got[0].dtype == torch.float32 and (got[0][targets == -100] == 0).all()
    for value, expected in zip(got, reference, strict=True):
        torch.testing.assert_close(value.double(), expected.double(), atol=1e-5, rtol=1e-5)


def test_under_autocast_it_computes_what_an_autocast_linear_head_does():
    """bf16 matmuls (as an nn.Linear head under autocast), the softmax in float32, float32 gradients."""
    hidden, weight, targets, row_weights = _inputs(seed=1)

    def plain(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t, reduction="none")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _losses_and_grads(linear_cross_entropy, hidden, weight, targets, row_weights)
        reference = _losses_and_grads(plain, hidden, weight, targets, row_weights)
    torch.testing.assert_close(got[0], reference[0], atol=1e-5, rtol=1e-5)  # the same bf16 logits
    assert got[1].dtype == got[2].dtype == torch.float32
    for value, expected in zip(got[1:], reference[1:], strict=True):  # bf16 gradient products, summed apart
        torch.testing.assert_close(value, expected, atol=0.05, rtol=0.02)


def test_no_tensor_of_the_full_logits_is_kept_for_the_backward_pass():
    hidden, weight, targets, _ = _inputs(positions=64, vocab=200)
    for losses_of, keeps_logits in ((linear_cross_entropy, False),
                                    (lambda h, w, t: F.cross_entropy(h @ w.T, t, reduction="none"), True)):
        kept = []

        def keep(tensor, kept=kept):
            kept.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            losses_of(hidden, weight, targets).sum().backward()
        assert (max(kept) >= 64 * 200) == keeps_logits
