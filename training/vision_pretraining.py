"""Supervised pre-training of a from-scratch ViT on the synthetic shapes, before the VLM is trained on top of
it.

Real runs start from a pretrained SigLIP; the tiny default has none to load offline. On a random frozen ViT
the VLM learns to count but not to bind colours and shapes to places (69.6% held out); trained through the LM
from the start, the ViT's features collapse before the LM learns to read them. This stage gives it what SigLIP
would bring: a linear probe on every patch token learns to name the shape, colour and size in that patch's
cell (labels from the scene generator, on fresh training-split scenes: the held-out split is never drawn), as
the first ViTs were pre-trained on labelled images. `train.lr_vision: 0` then keeps the ViT frozen while the
projector and the LM learn to read it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data import ImageProcessor, ShapesConfig
from data.synthetic import CELL_CLASSES, Split, add_noise, cell_labels, render, sample_scene_of
from models.vision_transformer import VisionTransformer

GRID = 3  # the scenes' cells per side


def patch_cells(grid_size: int) -> torch.Tensor:
    """The scene cell under each patch of a grid_size x grid_size patch grid (row-major), [grid_size**2]."""
    if grid_size % GRID:
        raise ValueError(f"the patch grid ({grid_size}x{grid_size}) must split evenly into the scenes' "
                         f"{GRID}x{GRID} cells")
    rows = torch.arange(grid_size) * GRID // grid_size
    return (rows[:, None] * GRID + rows[None, :]).flatten()


def scene_batch(shapes: ShapesConfig, processor: ImageProcessor, cells: torch.Tensor, count: int,
                rng: random.Random, split: Split = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """`count` fresh scenes of `split`: images [count, 3, H, W] and each patch's labels [count, patches,
    3]."""
    scenes = [sample_scene_of(split, rng, shapes.validation_fraction) for _ in range(count)]
    images = [render(scene, shapes.image_size, rng) for scene in scenes]
    if shapes.noise:
        images = [add_noise(image, shapes.noise,
                            np.random.default_rng(rng.getrandbits(63))) for image in images]
    labels = torch.tensor([cell_labels(scene) for scene in scenes])[:, cells]
    return torch.stack([processor(image) for image in images]), labels


def pretrain_vision(vision: VisionTransformer, processor: ImageProcessor, shapes: ShapesConfig, steps: int,
                    batch_size: int, lr: float, seed: int, device: torch.device,
                    report: Callable[[str], None] = print) -> tuple[nn.Linear, list[float]]:
    """Train `vision` in place with a per-patch (shape, colour, size) classifier for `steps` AdamW steps
    (constant `lr`); returns the classifier (logits for CELL_CLASSES' classes, concatenated) and the losses
    (the mean of the three cross-entropies). Training needs only the ViT afterwards."""
    sizes = [len(classes) for classes in CELL_CLASSES.values()]
    head = nn.Linear(vision.config.hidden_size, sum(sizes)).to(device)
    nn.init.normal_(head.weight, std=0.02, generator=torch.Generator(head.weight.device).manual_seed(seed))
    nn.init.zeros_(head.bias)
    cells, rng = patch_cells(vision.config.grid_size), random.Random(f"vision-pretraining:{seed}")

    def batch_loss() -> torch.Tensor:
        images, labels = scene_batch(shapes, processor, cells, batch_size, rng)
        logits = head(vision(images.to(device))).split(sizes, dim=-1)
        labels = labels.to(device)
        return sum(F.cross_entropy(part.flatten(0, 1), labels[..., k].flatten())
                   for k, part in enumerate(logits)) / len(sizes)

    vision.train()
    return head, optimize(batch_loss, [*vision.parameters(), *head.parameters()], steps, lr, report)


def optimize(batch_loss: Callable[[], torch.Tensor], parameters: list[nn.Parameter], steps: int, lr: float,
             report: Callable[[str], None]) -> list[float]:
    """`steps` AdamW steps (constant `lr`, no weight decay) on `batch_loss()`, a fresh batch's loss at each
    call; returns the losses, reported every 100 steps."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    losses = []
    for step in range(steps):
        loss = batch_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read only when reporting: no host sync per step
        if (step + 1) % 100 == 0 or step + 1 == steps:
            report(f"vision pre-training step {step + 1}/{steps}: loss {losses[-1].item():.4f}")
    return torch.stack(losses).tolist() if losses else []
