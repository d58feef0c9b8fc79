"""The output head and the cross-entropy in one step, a chunk of positions at a time, so that the full
[positions, vocabulary] logits (and their float32 copy, and its gradient) never exist at once.

    losses = linear_cross_entropy(hidden, head.weight, targets)  # [N], as F.cross_entropy(head(hidden), ...)

Memory: the logits of N positions over a vocabulary of V take N x V x (2 bytes in bf16, 4 for the float32
log-probabilities the loss keeps for the backward pass, 4 for their gradient): for a batch of 64 x 128 tokens
and SmolLM2's 49,152 words, 4 GB; a chunk of CHUNK_ELEMENTS logits, 0.3 GB. The backward pass computes each
chunk's logits again (one more head matmul, a few percent of a step's FLOPs) instead of keeping them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 2**25  # logits per chunk (128 MiB in float32): 682 positions of a 49,152-word vocabulary


def chunking_pays(head: nn.Module, positions: int) -> bool:
    """Whether the loss of `positions` over `head` (a plain bias-free nn.Linear, not an adapted one) spans
    more than one chunk; in one chunk the plain head + cross-entropy keeps no more and computes less."""
    return type(head) is nn.Linear and head.bias is None and positions * head.out_features > CHUNK_ELEMENTS


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax of a loss runs in: float32, or float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


def loss_precision(logits: Tensor) -> Tensor:
    """`logits` in `loss_dtype`."""
    return logits.to(loss_dtype(logits.dtype))


def _rows_per_chunk(weight: Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // weight.shape[0])


def _chunk_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    return loss_precision(hidden @ weight.T)


# Chunked linear + cross-entropy with recomputation in the backward pass (after Liger Kernel's fused linear
# cross-entropy, Hsu et al. 2024, which keeps no logits either).
class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype) -> Tensor:
        hidden_c, weight_c = hidden.to(dtype), weight.to(dtype)
        valid = targets != IGNORE_INDEX
        picked_ids = torch.where(valid, targets, 0)
        losses, log_normalizers = [], []
        rows = _rows_per_chunk(weight)
        for start in range(0, hidden.shape[0], rows):
            logits = _chunk_logits(hidden_c[start:start + rows], weight_c)
            log_normalizer = logits.logsumexp(-1)
            picked = logits.gather(1, picked_ids[start:start + rows, None])[:, 0]
            losses.append(log_normalizer - picked)
            log_normalizers.append(log_normalizer)
        ctx.save_for_backward(hidden, weight, picked_ids, valid, torch.cat(log_normalizers))
        ctx.dtype = dtype
        return torch.where(valid, torch.cat(losses), 0.0)

    @staticmethod
    def backward(ctx, grad_losses: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        hidden, weight, picked_ids, valid, log_normalizer = ctx.saved_tensors
        hidden_c, weight_c = hidden.to(ctx.dtype), weight.to(ctx.dtype)
        grad_rows = loss_precision(torch.where(valid, grad_losses, 0.0))
        grad_hidden, grad_weight = [], torch.zeros(weight.shape, dtype=loss_dtype(weight.dtype),
                                                    device=weight.device)
        rows = _rows_per_chunk(weight)
        for start in range(0, hidden.shape[0], rows):
            stop = start + rows
            chunk = hidden_c[start:stop]
            # d loss / d logits = softmax - one_hot(target), times each row's incoming gradient
            grad_logits = (_chunk_logits(chunk, weight_c) - log_normalizer[start:stop, None]).exp()
            grad_logits.scatter_add_(1, picked_ids[start:stop, None], -torch.ones_like(grad_logits[:, :1]))
            grad_logits = (grad_logits * grad_rows[start:stop, None]).to(ctx.dtype)
            grad_hidden.append(grad_logits @ weight_c)
            grad_weight += loss_precision(grad_logits.T @ chunk)
        return torch.cat(grad_hidden).to(hidden.dtype), grad_weight.to(weight.dtype), None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Each position's cross-entropy of the logits `hidden @ weight.T` against `targets` [N] (0 where the
    target is IGNORE_INDEX), in `loss_dtype`, [N]; `hidden` [N, C], `weight` [V, C]. Under autocast the
    matmuls run in its dtype, as an autocast `nn.Linear` head would; the softmax in `loss_dtype`."""
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, dtype)


def head_and_loss(hidden: Tensor, head: nn.Module, targets: Tensor | None, reduction: str = "mean",
                  return_logits: bool = True, chunked: bool = False) -> tuple[Tensor | None, Tensor | None]:
    """The logits `head(hidden)` [B, T, V] (None unless `return_logits`) and, given `targets` [B, T], the
    cross-entropy over the positions that have one: their mean, their sum, or (reduction="none") each
    position's own, [B, T]. `chunked` without logits: the head and the loss a chunk of positions at a time
    where that keeps less (`chunking_pays`)."""
    if chunked and targets is not None and not return_logits and chunking_pays(head, targets.numel()):
        losses = linear_cross_entropy(hidden.flatten(0, 1), head.weight, targets.flatten())
        if reduction == "none":
            return None, losses.view(targets.shape)
        return None, losses.sum() / ((targets != IGNORE_INDEX).sum() if reduction == "mean" else 1)
    logits = head(hidden)
    if targets is None:
        return logits if return_logits else None, None
    loss = F.cross_entropy(loss_precision(logits.flatten(0, 1)), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)
    return logits if return_logits else None, loss.view(targets.shape) if reduction == "none" else loss
