"""Vision pre-training on the synthetic scenes: patches map to cells, the ViT learns to name what each cell
shows, and a streamed run draws the labelled images from its shards."""

import itertools
import json
import random

import pytest
import torch

from data import ImageProcessor, ShapesConfig, make_shapes_dataset
from data.shards import write_shards, write_synthetic_shards
from data.streaming import SlotReader, Source, StreamConfig
from data.synthetic import CELL_CLASSES
from models.config import VisionConfig
from models.vision_transformer import VisionTransformer
from training.vision_pretraining import StreamedScenes, patch_cells, pretraining_on_scenes, scene_batch
from typed_config import ConfigError


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


def _streamed_scenes(directory, sources=None, holdout=4):
    """StreamedScenes over the synthetic shards of `directory` (its first `holdout` rows held out), 48 px in
    3x3 patches; and the ViT's processor."""
    processor = ImageProcessor.from_config(VisionConfig(image_size=48, patch_size=16, hidden_size=64,
                                                        intermediate_size=128, num_layers=1, num_heads=2))
    sources = sources or [Source.open(StreamConfig(files=str(directory / "*.parquet")), skip=holdout)]
    return StreamedScenes(sources, processor, grid_size=3, batch_size=4, seed=0, buffer_size=3), processor


def test_streamed_scenes_are_the_training_records_images_and_labels_in_the_streams_order(tmp_path):
    """Each batch: the next training rows the run's own stream reads (slot 0 of 1), as the in-memory records
    with those row numbers hold them: the image, and the labels of the scene drawn; no held-out row."""
    shapes = ShapesConfig(image_size=48, num_train=20, num_validation=4, train_turns=1)
    write_synthetic_shards(tmp_path, shapes, files=2, rows_per_group=3)
    common = dict(seed=shapes.seed, image_size=48, labels=True)
    memory = [*make_shapes_dataset("validation", 4, **common), *make_shapes_dataset("train", 20, **common)]
    scenes, processor = _streamed_scenes(tmp_path)
    order = [key for key, _ in itertools.islice(SlotReader(scenes.sources, 0, 1, 0, 3), 12)]  # training's
    rows = [int(key.rpartition("#")[2]) + (12 if "00001-of" in key else 0) for key in order]
    batches = [scenes.batch() for _ in range(3)]
    assert min(rows) >= 4 and len(set(rows)) == 12
    for number, (images, labels) in enumerate(batches):
        chunk = [memory[row] for row in rows[number * 4:(number + 1) * 4]]
        assert torch.equal(images, torch.stack([processor(record["images"][0]) for record in chunk]))
        assert torch.equal(labels, torch.tensor([record["cell_labels"] for record in chunk]))


def test_streamed_scenes_resume_where_they_stood(tmp_path):
    shapes = ShapesConfig(image_size=48, num_train=30, num_validation=4)
    write_synthetic_shards(tmp_path, shapes, rows_per_group=4)
    scenes, _ = _streamed_scenes(tmp_path)
    scenes.batch()
    state = json.loads(json.dumps(scenes.state_dict()))  # as a checkpoint keeps it
    expected = [scenes.batch() for _ in range(3)]
    resumed, _ = _streamed_scenes(tmp_path)
    resumed.load_state_dict(state)
    for (images, labels), (want_images, want_labels) in zip((resumed.batch() for _ in range(3)), expected):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


def test_streamed_scenes_pass_over_a_record_whose_image_does_not_decode(tmp_path):
    records = list(make_shapes_dataset("train", 12, seed=0, image_size=48, labels=True))
    write_shards(tmp_path / "good", records, rows_per_group=4)
    records[1] = {**records[1], "images": [{"bytes": b"not an image", "path": None}]}
    write_shards(tmp_path / "bad", records, rows_per_group=4)
    good, _ = _streamed_scenes(tmp_path / "good", holdout=0)
    bad, _ = _streamed_scenes(tmp_path / "bad", holdout=0)
    every = torch.cat([good.batch()[0] for _ in range(3)])  # all 12 rows, in the stream's order
    read = torch.cat([bad.batch()[0] for _ in range(2)])
    # both streams read their rows in the same order (the same layout and seed): all but row 1
    keys = [key for key, _ in itertools.islice(SlotReader(good.sources, 0, 1, 0, 3), 12)]
    order = [int(key.rpartition("#")[2]) for key in keys]
    assert torch.equal(read, every[[position for position, row in enumerate(order) if row != 1][:8]])


def test_a_stream_without_scene_labels_is_a_clear_error(tmp_path):
    write_shards(tmp_path, list(make_shapes_dataset("train", 8, seed=0, image_size=48)), rows_per_group=4)
    with pytest.raises(ConfigError, match="needs each record's scene labels .*training.write_shards"):
        _streamed_scenes(tmp_path, holdout=0)
