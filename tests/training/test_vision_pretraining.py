"""Vision pre-training on the synthetic scenes: patches map to cells, and the ViT learns to name what each
cell shows."""

import random

import pytest
import torch

from data import ImageProcessor, ShapesConfig
from data.synthetic import CELL_CLASSES
from models.config import VisionConfig
from models.vision_transformer import VisionTransformer
from training.vision_pretraining import patch_cells, pretraining_on_scenes, scene_batch


def test_patches_map_to_the_cell_they_lie_in():
    assert patch_cells(3).tolist() == list(range(9))
    assert patch_cells(6).view(6, 6)[::2, ::2].flatten().tolist() == list(range(9))
    assert (patch_cells(6).view(3, 2, 3, 2) == torch.arange(9).view(3, 1, 3, 1)).all()
    with pytest.raises(ValueError, match="3x3"):
        patch_cells(4)


def test_the_vit_learns_to_name_each_cells_shape_colour_and_size():
    """After pre-training, the ViT + classifier read the cells of held-out scenes, far above always saying
    "empty"."""
    torch.manual_seed(0)
    vision = VisionTransformer(VisionConfig(image_size=48, patch_size=16, hidden_size=64,
                                            intermediate_size=128, num_layers=2, num_heads=2,
                                            image_mean=(0.9, 0.886, 0.878), image_std=(0.13, 0.15, 0.19)))
    processor, shapes = ImageProcessor.from_config(vision.config), ShapesConfig(image_size=48)
    images, labels = scene_batch(shapes, processor, patch_cells(3), 200, random.Random(1), "validation")
    sizes = [len(classes) for classes in CELL_CLASSES.values()]
    pretraining = pretraining_on_scenes(vision, processor, shapes, 150, 32, 3e-3, 0, torch.device("cpu"))
    assert pretraining.run(report=lambda _: None)
    head, losses = pretraining.head, pretraining.loss_history()
    with torch.no_grad():
        logits = head(vision.eval()(images)).split(sizes, dim=-1)
    accuracy = [(part.argmax(-1) == labels[..., k]).float().mean().item() for k, part in enumerate(logits)]
    # always the most frequent label ("empty": ~78%)
    majority = [
        labels[..., k].flatten().bincount().max().item() / labels[..., k].numel() for k in range(len(sizes))
    ]
    assert len(losses) == 150 and losses[-1] < 0.2 * losses[0]
    assert all(a > max(0.95, m + 0.15) for a, m in zip(accuracy, majority)), (accuracy, majority)
