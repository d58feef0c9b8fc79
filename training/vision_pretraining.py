"""Supervised pre-training of a from-scratch ViT on the synthetic shapes, before the VLM is trained on top of
it.

Real runs start from a pretrained SigLIP; the tiny default has none to load offline. On a random frozen ViT
the VLM learns to count but not to bind colours and shapes to places (69.6% held out); trained through the LM
from the start, the ViT's features collapse before the LM learns to read them. This stage gives it what SigLIP
would bring: a linear probe on every patch token learns to name the shape, colour and size in that patch's
cell (labels from the scene generator, on fresh training-split scenes: the held-out split is never drawn), as
the first ViTs were pre-trained on labelled images. `train.lr_vision: 0` then keeps the ViT frozen while the
projector and the LM learn to read it. A streamed run (data.source=stream) draws its labelled images from the
stream instead: the synthetic set's shards carry each scene's labels (`python -m training.write_shards`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data import ImageProcessor, ShapesConfig
from data.bad_records import checked_record
from data.streaming import SlotReader, Source
from data.synthetic import CELL_CLASSES, Split, add_noise, cell_labels, render, sample_scene_of
from models.vision_transformer import VisionTransformer
from training.progress import Every
from typed_config import check

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


def random_state(rng: random.Random) -> list:
    """`rng`'s state as JSON (`set_random_state` restores it)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_random_state(rng: random.Random, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


class Draws(Protocol):
    """What draws a pre-training's batches, with the state a checkpoint keeps (JSON) to draw on exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Scenes:
    """`batch_size` fresh training-split scenes at a time, with each patch's labels (`scene_batch`), from a
    seeded stream."""

    def __init__(self, shapes: ShapesConfig, processor: ImageProcessor, grid_size: int, batch_size: int,
                 seed: int) -> None:
        self.shapes, self.processor, self.batch_size = shapes, processor, batch_size
        self.cells, self.rng = patch_cells(grid_size), random.Random(f"vision-pretraining:{seed}")

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return scene_batch(self.shapes, self.processor, self.cells, self.batch_size, self.rng)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": random_state(self.rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_random_state(self.rng, state["rng"])


class StreamedScenes:
    """`batch_size` labelled images at a time, read from streamed sources whose records carry `cell_labels`
    (data/shards.py `write_synthetic_shards`): one reader over the whole stream (every rank reads the same,
    as every rank draws the same fresh scenes), its position the state. A record with no image, or one that
    does not decode, is passed over."""

    def __init__(self, sources: list[Source], processor: ImageProcessor, grid_size: int, batch_size: int,
                 seed: int, buffer_size: int) -> None:
        for source in sources:
            check("cell_labels" in source.passed,
                  f"{source.name}: the ViT's cells pre-training needs each record's scene labels (a "
                  "cell_labels column: python -m training.write_shards writes them), or "
                  "train.vision_pretrain_steps 0")
        self.sources, self.processor, self.batch_size = sources, processor, batch_size
        self.cells, self.seed, self.buffer_size = patch_cells(grid_size), seed, buffer_size
        self.reader = SlotReader(sources, 0, 1, seed, buffer_size)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = [], []
        while len(images) < self.batch_size:
            _, record = next(self.reader)
            try:
                image = checked_record(record)["images"][0] if record and record["images"] else None
            except Exception:  # noqa: BLE001 - whatever makes a record bad (data/bad_records.py)
                continue
            if image is not None:
                images.append(self.processor(image))
                labels.append(record["cell_labels"])
        return torch.stack(images), torch.tensor(labels)[:, self.cells]

    def state_dict(self) -> dict[str, Any]:
        return {"reader": self.reader.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reader = SlotReader(self.sources, 0, 1, self.seed, self.buffer_size, state["reader"])


@dataclasses.dataclass
class Pretraining:
    """A ViT pre-training under way: a fresh batch's loss, the module trained beside the ViT and thrown away
    after it (a classifier or a reader), the AdamW of both (constant learning rate, no weight decay), what
    draws the batches, and how far it got. With the ViT's weights, this is all a checkpoint needs to continue
    it exactly (training/checkpoint.py `save_pretraining`)."""

    batch_loss: Callable[[], torch.Tensor]
    head: nn.Module
    optimizer: torch.optim.Optimizer
    draws: Draws
    steps: int
    step: int = 0
    # each step's loss: a tensor, read only when reported (no host sync per step), or a checkpoint's float
    losses: list[torch.Tensor | float] = dataclasses.field(default_factory=list)

    @classmethod
    def start(cls, batch_loss: Callable[[], torch.Tensor], vision: VisionTransformer, head: nn.Module,
              draws: Draws, steps: int, lr: float) -> Pretraining:
        """A pre-training of `vision` and `head` at step 0, the ViT in training mode."""
        vision.train()
        optimizer = torch.optim.AdamW([*vision.parameters(), *head.parameters()], lr=lr, weight_decay=0.0)
        return cls(batch_loss, head, optimizer, draws, steps)

    def run(self, report: Callable[[str], None] = print, stop: Callable[[], bool] = lambda: False) -> bool:
        """Train from `step` to `steps`, reporting the loss every REPORT_S seconds and at the last step;
        `stop()`, asked before each step, ends it early. Returns whether it reached `steps`."""
        every = Every()
        while self.step < self.steps:
            if stop():
                return False
            loss = self.batch_loss()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            loss = loss.detach()
            self.losses.append(loss)
            if every.due() or self.step == self.steps:
                report(f"vision pre-training step {self.step}/{self.steps}: loss {float(loss):.4f}")
        return True

    def loss_history(self) -> list[float]:
        """The losses so far as floats: the steps' tensors read back from the device at once (a resumed
        checkpoint's are floats already)."""
        tensors = [loss for loss in self.losses if torch.is_tensor(loss)]
        values = iter(torch.stack(tensors).tolist() if tensors else [])
        return [next(values) if torch.is_tensor(loss) else loss for loss in self.losses]


def pretraining_on_scenes(vision: VisionTransformer, processor: ImageProcessor, shapes: ShapesConfig,
                          steps: int, batch_size: int, lr: float, seed: int, device: torch.device,
                          scenes: Scenes | StreamedScenes | None = None) -> Pretraining:
    """A pre-training (`Pretraining.run` trains it) of `vision` in place, with a per-patch (shape, colour,
    size) classifier (logits for CELL_CLASSES' classes, concatenated; the loss: the mean of the three
    cross-entropies), on `scenes` (default: fresh scenes as `shapes` describes them). Training needs only the
    ViT afterwards."""
    sizes = [len(classes) for classes in CELL_CLASSES.values()]
    head = nn.Linear(vision.config.hidden_size, sum(sizes)).to(device)
    nn.init.normal_(head.weight, std=0.02, generator=torch.Generator(head.weight.device).manual_seed(seed))
    nn.init.zeros_(head.bias)
    scenes = scenes or Scenes(shapes, processor, vision.config.grid_size, batch_size, seed)

    def batch_loss() -> torch.Tensor:
        images, labels = scenes.batch()
        logits = head(vision(images.to(device))).split(sizes, dim=-1)
        labels = labels.to(device)
        return sum(F.cross_entropy(part.flatten(0, 1), labels[..., k].flatten())
                   for k, part in enumerate(logits)) / len(sizes)

    return Pretraining.start(batch_loss, vision, head, scenes, steps, lr)
